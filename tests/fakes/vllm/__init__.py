"""A stand-in for vLLM (not installable on the test machine: it needs a GPU) that does what vLLM does for the calls
finetune makes (``finetune/tasks/vllm_generation.py``), on a float32 copy of the Hugging Face model on the CPU. Only
tests import it, by putting ``tests/fakes`` first on the path. What each part follows in vLLM (read at the commits
the code index holds; the engine's internals are v1's):

- ``LLM(model, *, tensor_parallel_size, gpu_memory_utilization, max_model_len, distributed_executor_backend, seed,
  **kwargs)``: ``vllm/entrypoints/llm.py`` ``LLM.__init__`` (the weights of ``model`` loaded once; the engine reached
  as ``llm.llm_engine.model_executor.driver_worker.model_runner.model``, the path TRL 1.16 loads weights through,
  ``trl/generation/vllm_generation.py`` line 511). ``distributed_executor_backend="external_launcher"`` reads the
  process group from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: the fake refuses it without them.
- ``model.load_weights(weights)``: an iterable of (checkpoint name, tensor), each copied into the parameter of that
  name, a name the model lacks a ``KeyError`` (``vllm/model_executor/models/llama.py`` ``load_weights``:
  ``param = params_dict[name]`` then ``weight_loader(param, loaded_weight)``); a tied output embedding is the input
  embedding, so loading one loads both; returns the names loaded (``AutoWeightsLoader.load_weights``' set).
- ``LLM.generate(prompts, sampling_params, use_tqdm)``: one ``RequestOutput`` per prompt, in the prompts' order;
  ``sampling_params`` one for all or a list paired one by one with the prompts, another length a ``ValueError``
  (``llm.py`` ``generate``'s docstring and ``_validate_and_add_requests``). A prompt is a ``TokensPrompt``,
  ``{"prompt_token_ids": [...]}``.
- ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, stop_token_ids, ignore_eos)``: the fields and
  defaults of ``vllm/sampling_params.py`` (``n`` 1, ``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` 0 = off,
  ``max_tokens`` 16, ``seed`` None); ``n`` samples of a request are children seeded ``seed + k``
  (``vllm/v1/engine/parallel_sampling.py`` ``ParentRequest._get_child_sampling_params``), each drawn from its own
  ``torch.Generator`` seeded with its seed; a token is ``argmax(probs / q)``, ``q ~ Exp(1)`` from that generator
  (``vllm/v1/sample/ops/topk_topp_sampler.py`` ``random_sample``) after the logits are divided by the temperature
  and cut to the top-p nucleus (``apply_top_k_top_p``: ascending sort, drop tokens whose cumulative probability is
  at most ``1 - top_p``, the most likely always kept); temperature below 1e-5 is greedy (``_SAMPLING_EPS``).
  A completion stops after a token of ``stop_token_ids`` or the tokenizer's EOS (not with ``ignore_eos``), that
  token included in ``token_ids`` (finish reason ``stop``), or at ``max_tokens`` (``length``).
- ``RequestOutput(request_id, prompt, prompt_token_ids, outputs, finished)`` and ``CompletionOutput(index, text,
  token_ids, cumulative_logprob, logprobs, finish_reason)``: ``vllm/outputs.py``.
- ``LLM.reset_prefix_cache()``: returns True (nothing is cached here).

For the tests it records, in ``GENERATIONS``, each ``generate`` call: the model's weights at that moment and each
request's prompt, seed and completions; in ``ENGINES``, each engine's constructor arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__version__ = "0.0.0+fake"
_SAMPLING_EPS = 1e-5
ENGINES: list[dict] = []
GENERATIONS: list[dict] = []


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):  # vLLM's _verify_args: the bounds of these fields
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class _Model:
    """The engine's model: ``load_weights`` by checkpoint name into the Hugging Face copy."""

    def __init__(self, hf_model):
        self.hf = hf_model

    def load_weights(self, weights) -> set[str]:
        params = dict(self.hf.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)  # KeyError for a name the model lacks, as vLLM's params_dict[name]
                loaded.add(name)
        return loaded


class _Namespace:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    def __init__(self, model: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, distributed_executor_backend: str | None = None,
                 seed: int | None = None, **kwargs):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if distributed_executor_backend == "external_launcher":
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise RuntimeError(f"external_launcher needs {missing} in the environment")
        ENGINES.append(dict(model=model, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            distributed_executor_backend=distributed_executor_backend, seed=seed, **kwargs))
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.eos = AutoTokenizer.from_pretrained(model).eos_token_id
        self.model = _Model(hf)
        runner = _Namespace(model=self.model)
        self.llm_engine = _Namespace(model_executor=_Namespace(driver_worker=_Namespace(model_runner=runner)))
        self.seed, self.requests = seed, 0

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True, **kwargs) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or
                                                                                      SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and params must be the same.")
        record = {"weights": {k: v.detach().clone() for k, v in self.model.hf.state_dict().items()}, "requests": []}
        outputs = []
        for prompt, sp in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            children = [self._sample(ids, sp, None if sp.seed is None else sp.seed + k) for k in range(sp.n)]
            outputs.append(RequestOutput(str(self.requests), None, ids, None,
                                         [CompletionOutput(k, "", c, None, None, reason)
                                          for k, (c, reason) in enumerate(children)]))
            record["requests"].append({"prompt_token_ids": ids, "seed": sp.seed, "n": sp.n,
                                       "completions": [c for c, _ in children]})
            self.requests += 1
        GENERATIONS.append(record)
        return outputs

    def _sample(self, prompt: list[int], sp: SamplingParams, seed: int | None) -> tuple[list[int], str]:
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else (self.seed or 0) * 1000003 + self.requests)
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else {self.eos})
        out = []
        with torch.no_grad():
            while len(out) < (sp.max_tokens or 16):
                logits = self.model.hf(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
                if sp.temperature < _SAMPLING_EPS:
                    token = int(logits.argmax())
                else:
                    probs = _top_p(logits / sp.temperature, sp.top_p).softmax(-1)
                    q = torch.empty_like(probs).exponential_(generator=generator)
                    token = int(probs.div(q).argmax())
                out.append(token)
                if token in stops:
                    return out, "stop"
        return out, "length"


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """vLLM's top-p cut (``apply_top_k_top_p``): tokens outside the nucleus set to -inf."""
    if p >= 1.0:
        return logits
    ordered, index = logits.sort(descending=False)
    cumulative = ordered.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - p
    drop[-1] = False  # the most likely token always stays
    return logits.scatter(0, index, ordered.masked_fill(drop, -float("inf")))
