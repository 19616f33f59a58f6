"""The machines a run trains on, and what runs on each before any trainer does.

On the controller's side: the host providers (`base` defines Host and HostProvider; `local`,
`addresses` and `sky` provide them; `choice` picks one from the job's settings). On each node:
its worker (`worker`), its checks (`doctor`), the run's certificates (`tls`) and the
lighthouse's TLS gate and doors (`lighthouse_gate`).
"""
