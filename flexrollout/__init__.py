"""flexrollout: a pure-PyTorch rollout engine with vLLM's offline `LLM` API."""
from .config import EngineConfig
from .llm import LLM, FlexEngine
from .lora_request import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "FlexEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest"]
__version__ = "0.1.0"
