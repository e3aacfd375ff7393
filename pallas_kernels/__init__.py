"""Pallas GPU kernels of jaxkv (slot-mapped cache writes, paged MQA logits, sparse MLA decode)."""
