"""PyTorch adapter (needs ``torch``): see docs/adapters.md.

- ``GiftState`` + ``gift_hook``: a DDP communication hook (``ddp.register_comm_hook``).
- ``GradSync``: gradient synchroniser for plain loops under mpiexec (no torch.distributed).
- ``ShardedGradSync``: ZeRO/Megatron-style reduce-scatter of a flat padded gradient buffer.
- ``GiftReduceScatter`` + ``register_reduce_scatter``: FSDP2's gradient reduce-scatter through giftcomm.
- ``new_group``, ``GiftProcessGroup``, ``Policy``, ``group_stats``: a torch.distributed process group (backend "giftcomm")
  that reduces through giftcomm; hand it to DDP, Megatron-core, ... as their group.
- ``KfacCapture``, ``build_geometries``: KFAC factors from nn.Linear hooks, per-bucket geometries.
- ``make_buckets``, ``numpy_view``: flat float buffers whose views are the ``.grad`` tensors.
"""
from .buckets import GradBucket, make_buckets, named_trainable, numpy_view
from .ddp import GiftState, gift_hook
from .fsdp import GiftReduceScatter, register_reduce_scatter
from .grad_sync import GradSync, SyncTimes
from .kfac import KfacCapture, build_geometries, model_layout
from .process_group import GiftProcessGroup, Policy, group_stats, new_group
from .sharded_sync import ShardedGradSync

__all__ = ["GiftState", "gift_hook", "GiftReduceScatter", "register_reduce_scatter",
           "GiftProcessGroup", "Policy", "new_group", "group_stats",
           "GradSync", "ShardedGradSync", "SyncTimes", "KfacCapture", "build_geometries", "model_layout", "GradBucket",
           "make_buckets", "named_trainable", "numpy_view"]
