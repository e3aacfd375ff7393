"""Models served by jaxkv."""
