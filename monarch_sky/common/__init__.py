"""What every side imports: the controller, the trainer processes and the nodes' workers.

The accelerator shims (`platform`), Monarch's settings and failure routing (`supervision`), the
checkpoint folder's layout (`checkpoints`), the hub's tokenizers and datasets (`hub_assets`) and
the switches only tests set (`test_hooks`). Nothing here imports another monarch_sky package.
"""
