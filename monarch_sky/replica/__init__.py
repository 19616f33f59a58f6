"""Inside a trainer process: one rank of a replica group.

The Monarch actor the controller calls (`actor`, and `fault_actor` for injected faults), the
TorchTitan trainer it drives (`trainer`, `diloco_join`, `trainer_checkpoint`), TorchFT's heal
state and transports (`healing`, `heal_transport` with `heal_tcp`, `heal_rdma`, `heal_wire`), and
what a step reports (`step_result`, `data_position`, `digest`, `quorum_members`).
"""
