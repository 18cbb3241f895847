"""worker: the Ray actor that hosts one engine in either role (prefill or decode)."""
