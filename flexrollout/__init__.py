"""flexrollout: a pure-PyTorch rollout engine with vLLM's offline `LLM` API."""
from .config import EngineConfig
from .integrations import patch_trl
from .llm import LLM, FlexEngine
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput, TokenDelta
from .sampling_params import SamplingParams

__all__ = ["LLM", "FlexEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "TokenDelta", "LoRARequest", "patch_trl"]
__version__ = "0.1.0"
