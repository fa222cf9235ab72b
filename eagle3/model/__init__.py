"""The EAGLE-3 draft model (Llama-style midlayer, optional Qwen3 q/k norms)."""
from .draft import Eagle3Draft, Eagle3DraftConfig, draft_config_dict

__all__ = ["Eagle3Draft", "Eagle3DraftConfig", "draft_config_dict"]
