"""Model families (torch, Hugging Face parameter names), their configs, the loader, the default model."""
