"""pegaserve: prefill/decode-disaggregated LLM serving. This package never imports Ray."""

__version__ = "0.1.0"
