"""Layers that synchronise across the replicas of a parallel call."""
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from .embedding import HostEmbedding

__all__ = ['SyncBatchNorm', 'convert_sync_batchnorm', 'revert_sync_batchnorm', 'HostEmbedding']
