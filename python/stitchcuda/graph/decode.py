"""Greedy generation over a static KV cache the program owns: a prefill program (the prompt) and a decode
program (one token; one fixed shape per batch, so it replays as a CUDA graph), both updating the model's
cache buffers in place (program states), and the token loop around them. See docs/decode.md.

    lm = MyStaticCacheLM(...)                    # forward(input_ids, cache_position) -> logits
    gen = stitchcuda.StaticCacheGenerator.optimize(lm, batch_size=1, prompt_length=128, max_length=512)
    tokens = gen.generate(prompt_ids, max_new_tokens=64)

For a transformers causal LM, `StaticCacheGenerator.for_transformers(model, ...)` runs its forward with a
StaticCache whose tensors are the programs' states (TransformersStaticCacheLM).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgumentError
from ..log import get_logger
from .module import NoProgramError, OptimizedModule
from .optimize import optimize

__all__ = ["StaticCacheGenerator", "TransformersStaticCacheLM"]

log = get_logger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, cache_position) -> logits


class StaticCacheGenerator:
    """Greedy decoding with a causal LM in the static-cache style: ``forward(input_ids, cache_position)``
    returns logits ``[batch, tokens, vocab]`` and writes each layer's keys and values into cache buffers of
    ``max_length`` positions at ``cache_position`` (``index_copy_``), its attention masked by the positions.

    `prefill` and `decode` run the forward for the prompt and for one token (optimized modules from
    `StaticCacheGenerator.optimize`, or any callables of that signature; default: the model itself). Both
    update the same cache. The generator keeps the position: `prefill` starts a sequence at 0, `step`
    appends one token, `generate` does both; a sequence past `max_length` is refused before anything runs.
    `caches`: the cache tensors `reset()` zeroes (the programs' states where the generator built them).
    `prefill_module` and `decode_module` are what runs (an OptimizedModule's `.report` says what it does)."""

    def __init__(self, model: torch.nn.Module, *, max_length: int, batch_size: int | None = None,
                 prefill: Step | None = None, decode: Step | None = None, caches: Sequence[torch.Tensor] = ()) -> None:
        if int(max_length) < 1:
            raise InvalidArgumentError(f"max_length must be at least 1 (the cache's positions), not {max_length}")
        self.model = model
        self.max_length = int(max_length)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.prefill_module = prefill or model
        self.decode_module = decode or model
        # The given caches (the programs' states) and the tensors a wrapper says its forward updates (a
        # transformers cache layer's own counters among them), which a program that fell back has no state for.
        self.caches: list[torch.Tensor] = []
        for t in [*caches, *getattr(model, "cache_tensors", list)()]:
            if all(t is not c for c in self.caches):
                self.caches.append(t)
        self.position = 0  # the next position the cache gets written at
        self._cache_position: torch.Tensor | None = None  # decode's one-position input, updated in place

    # ---- building ----

    @classmethod
    def optimize(cls, model: torch.nn.Module, *, batch_size: int, prompt_length: int, max_length: int,
                 device: torch.device | str | None = None, **options: Any) -> "StaticCacheGenerator":
        """Optimizes `model` twice with stitchcuda.optimize (`options` are its keyword arguments): for a
        prompt of `prompt_length` tokens and for one token, both at `batch_size`. Other prompt lengths run
        the model itself for their prefill (the decode program still runs every step after it). The model's
        cache buffers are the programs' states: both read and update them in place."""
        if not 1 <= int(prompt_length) < int(max_length):
            raise InvalidArgumentError(f"prompt_length must be at least 1 and below max_length ({max_length}) so that "
                                       f"a token can follow it, not {prompt_length}")
        device = torch.device(device) if device is not None else _device_of(model)
        ids = torch.zeros(batch_size, prompt_length, dtype=torch.long, device=device)
        prefill = optimize(model, (ids, torch.arange(prompt_length, device=device)), **options)
        one = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        decode = optimize(model, (one, torch.tensor([prompt_length], device=device)), **options)
        caches = [*_states_of(prefill), *_states_of(decode)]
        generator = cls(model, max_length=max_length, batch_size=batch_size, prefill=prefill, decode=decode,
                        caches=caches)
        generator.reset()  # optimize() ran the forward on its example and check inputs
        return generator

    @classmethod
    def for_transformers(cls, model: torch.nn.Module, *, batch_size: int, prompt_length: int, max_length: int,
                         **options: Any) -> "StaticCacheGenerator":
        """`optimize` for a transformers causal LM: its forward runs with a StaticCache of `max_length`
        positions whose tensors are the programs' states (TransformersStaticCacheLM)."""
        return cls.optimize(TransformersStaticCacheLM(model, batch_size=batch_size, max_length=max_length),
                            batch_size=batch_size, prompt_length=prompt_length, max_length=max_length, **options)

    # ---- saving ----

    def save(self, path: str | os.PathLike) -> None:
        """Writes the prefill and decode programs as one file (their weights once, the cache as their paired
        states, ``max_length``): ``stitchcuda.load(path)`` runs its token loop in C++, as does
        ``torch::Generator::load`` and ``serve generate`` without Python (docs/decode.md). Both modules must
        run programs (an OptimizedModule whose report.status is 'optimized'), over the same cache tensors."""
        from ..program import DecodePrograms, Program

        programs = []
        for role, module in (("prefill", self.prefill_module), ("decode", self.decode_module)):
            program = getattr(module, "program", None)
            if not isinstance(program, Program):
                report = getattr(module, "report", None)
                why = f" ({report.reason})" if getattr(report, "reason", None) else ""
                raise NoProgramError(f"nothing to save: the {role} runs {type(module).__name__}, not a stitched program"
                                     f"{why}; save a generator whose prefill_module and decode_module both have a "
                                     "program (StaticCacheGenerator.optimize on a GPU, both reports 'optimized')")
            programs.append(program)
        pair = DecodePrograms(*programs, max_length=self.max_length)
        # The file pairs states by name; where both programs read a model's tensor, it must be the same one.
        names = [{b["id"]: b["name"] for b in p.buffers if b["role"] == "state"} for p in programs]
        for mine, theirs in pair.state_pairs:
            a, b = programs[0].shared_weights.get(mine), programs[1].shared_weights.get(theirs)
            if a is not None and b is not None and a is not b:
                raise InvalidArgumentError(f"the prefill's state '{names[0][mine]}' and the decode's are different "
                                           "tensors: build both programs from one model (StaticCacheGenerator.optimize)")
        pair.save(path)

    # ---- the cache ----

    def reset(self) -> None:
        """Starts over: position 0 and zeroed caches (positions beyond a sequence are masked, so stale
        values are never read; zeroes keep a NaN written by an earlier call out of masked products)."""
        for cache in self.caches:
            cache.zero_()
        self.position = 0

    def _reserve(self, tokens: int, what: str) -> None:
        if self.position + tokens > self.max_length:
            raise InvalidArgumentError(
                f"{what} needs positions {self.position}..{self.position + tokens - 1} but the cache holds "
                f"{self.max_length} (max_length): build the model with a longer cache, or ask for fewer tokens")

    def _check_batch(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"input_ids must be a [batch, tokens] integer tensor, not {ids.dtype}"
                                       f"{list(ids.shape)}")
        if self.batch_size is not None and ids.shape[0] != self.batch_size:
            raise InvalidArgumentError(f"input_ids hold a batch of {ids.shape[0]} but the cache was built for "
                                       f"{self.batch_size}: pass {self.batch_size} sequences, or build a generator for "
                                       "this batch size")

    # ---- running ----

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Starts a sequence with the prompt `input_ids` [batch, tokens]: writes positions 0..tokens-1 of
        the cache and returns the logits of the prompt's last token, [batch, vocab]."""
        self._check_batch(input_ids)
        tokens = input_ids.shape[1]
        self.position = 0
        self._reserve(tokens, f"a prompt of {tokens} tokens")
        # A new sequence starts from zeroed caches: a cache that counts its own writes (a transformers 5
        # StaticCache layer's cumulative_length) would otherwise append after the last sequence.
        self.reset()
        positions = torch.arange(tokens, device=input_ids.device)
        logits = self.prefill_module(input_ids, positions)
        self.position = tokens
        return logits[:, -1]

    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Appends one token per sequence (`token_ids` [batch] or [batch, 1]) at the current position and
        returns the next logits, [batch, vocab]."""
        ids = token_ids.reshape(-1, 1)
        self._check_batch(ids)
        if self.position == 0:
            raise InvalidArgumentError("step() continues a sequence: call prefill() with the prompt first")
        self._reserve(1, "one more token")
        if self._cache_position is None or self._cache_position.device != ids.device:
            self._cache_position = torch.zeros(1, dtype=torch.long, device=ids.device)
        self._cache_position.fill_(self.position)  # on the device: the loop never waits for the host
        logits = self.decode_module(ids, self._cache_position)
        self.position += 1
        return logits[:, -1]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | None = None) -> torch.Tensor:
        """Greedy continuation of the prompts `input_ids` [batch, tokens]: the prompt followed by
        `max_new_tokens` tokens, [batch, tokens + max_new_tokens] (fewer once every sequence has produced
        `eos_token_id`, which then repeats). The whole sequence must fit the cache: checked first."""
        if int(max_new_tokens) < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        self._check_batch(input_ids)
        self.position = 0
        # The last new token is never written to the cache: the prompt and max_new_tokens - 1 are.
        self._reserve(input_ids.shape[1] + max_new_tokens - 1,
                      f"a prompt of {input_ids.shape[1]} tokens and {max_new_tokens} new ones")
        out = [input_ids]
        token = self.prefill(input_ids).argmax(-1)
        done = None if eos_token_id is None else token == eos_token_id
        out.append(token[:, None])
        for _ in range(int(max_new_tokens) - 1):
            if done is not None and bool(done.all()):
                break
            nxt = self.step(token).argmax(-1)
            if done is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done = done | (nxt == eos_token_id)
            token = nxt
            out.append(token[:, None])
        return torch.cat(out, dim=1)


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _states_of(module: Any) -> list[torch.Tensor]:
    """The tensors an optimized module's program updates in place (its shared states)."""
    program = module.program if isinstance(module, OptimizedModule) else None
    if program is None:
        return []
    shared = program.shared_weights
    return [shared[b] for b in program.states if b in shared]


class TransformersStaticCacheLM(torch.nn.Module):
    """A transformers causal LM as ``forward(input_ids, cache_position) -> logits`` over a StaticCache of
    `max_length` positions for `batch_size` sequences. Every tensor the cache's layers hold — the keys and
    values, and a layer's own counters where it keeps some — is registered as this module's buffer
    (``layer<i>_keys``, ``layer<i>_values``, ...) and handed back to the cache at every call, so torch.export
    traces their updates as buffer mutations (program states) and the programs update these very tensors."""

    def __init__(self, model: torch.nn.Module, *, batch_size: int, max_length: int) -> None:
        super().__init__()
        from transformers import StaticCache  # the caller's transformers; not a StitchCUDA dependency

        self.model = model
        self.training = model.training  # a wrapper in the model's mode: optimize() takes an eval-mode model
        config = model.config
        device = _device_of(model)
        dtype = next(model.parameters()).dtype
        try:
            cache = StaticCache(config=config, max_cache_len=max_length)
        except TypeError:  # transformers before 4.56 sized the cache at construction
            cache = StaticCache(config=config, max_batch_size=batch_size, max_cache_len=max_length, device=device,
                                dtype=dtype)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if hasattr(cache, "early_initialization"):  # layers allocate lazily otherwise, at the first update
            cache.early_initialization(batch_size, heads, head_dim, dtype, device)
        self.cache = cache
        # transformers 5.25 renamed the forward's past_key_values to cache (the old name warns until 5.40)
        accepted = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in accepted else "past_key_values"
        # Generation reads the last position's logits only: the LM head over the whole prompt would be a
        # [batch, prompt, vocab] product (8.4 GB in fp32 at 32 x 2,048 x 32,000) nobody reads.
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._places = _cache_tensors(cache)  # buffer name -> where the cache keeps that tensor
        for name, place in self._places.items():
            self.register_buffer(name, _get(place), persistent=False)

    def cache_tensors(self) -> list[torch.Tensor]:
        """The tensors the forward updates: the cache's keys and values and a layer's own counters."""
        return [getattr(self, name) for name in self._places]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for name, place in self._places.items():
            _set(place, getattr(self, name))
        out = self.model(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                         **{self._cache_argument: self.cache}, **self._last_only)
        return out.logits


Place = tuple[Any, Any]  # (an object and an attribute name, or a list and an index)


def _cache_tensors(cache: Any) -> dict[str, Place]:
    """Where a StaticCache keeps its tensors, by the buffer name they get: every tensor attribute of
    ``layers[i]`` (transformers 4.56 and later: keys, values, and what else a layer keeps), or
    ``key_cache[i]``/``value_cache[i]`` (before)."""
    layers = getattr(cache, "layers", None)
    if layers and all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return {f"layer{i}_{attr}": (layer, attr) for i, layer in enumerate(layers)
                for attr, value in vars(layer).items() if isinstance(value, torch.Tensor)}
    if getattr(cache, "key_cache", None) is not None:
        return {**{f"layer{i}_keys": (cache.key_cache, i) for i in range(len(cache.key_cache))},
                **{f"layer{i}_values": (cache.value_cache, i) for i in range(len(cache.value_cache))}}
    raise InvalidArgumentError("this transformers StaticCache keeps its tensors where StitchCUDA does not look "
                               "(layers[i].keys or key_cache[i]): write the model's forward in the static-cache style "
                               "and use StaticCacheGenerator directly")


def _get(place: Place) -> torch.Tensor:
    owner, key = place
    return owner[key] if isinstance(owner, list) else getattr(owner, key)


def _set(place: Place, value: torch.Tensor) -> None:
    owner, key = place
    if isinstance(owner, list):
        owner[key] = value
    else:
        setattr(owner, key, value)
