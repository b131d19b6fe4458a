"""Generation (greedy or sampled) over a static KV cache the program owns: prefill programs (the prompt: one per
power-of-two length bucket, or one for an exact length) and a decode program (one token; one fixed shape
per batch, so it replays as a CUDA graph), all updating the model's cache buffers in place (program
states), and the token loop around them. See docs/decode.md.

    lm = MyStaticCacheLM(...)                    # forward(input_ids, cache_position) -> logits
    gen = stitchcuda.StaticCacheGenerator.optimize(lm, batch_size=8, max_length=512, prompt_lengths=256)
    tokens = gen.generate(prompt_ids, max_new_tokens=64)   # any prompt length up to 256, up to 8 sequences

For a transformers causal LM, `StaticCacheGenerator.for_transformers(model, ...)` runs its forward with a
StaticCache whose tensors are the programs' states (TransformersStaticCacheLM).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import InvalidArgumentError
from ..log import get_logger
from .dynamic import MAX_RESIDENT
from .module import NoProgramError, OptimizedModule
from .optimize import optimize

__all__ = ["StaticCacheGenerator", "TransformersStaticCacheLM", "LastPositionLogits", "prefill_model",
           "bucket_lengths", "check_padded_prefill", "BUCKET_FLOOR", "next_tokens", "check_sampling",
           "EOS_CHECK_EVERY"]

log = get_logger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, cache_position) -> logits
# (input_ids [batch, bucket], cache_position [bucket], last [1]) -> the logits at position `last`, [batch, 1, vocab]
BucketStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The smallest bucket of prompt_lengths=<longest>: shorter prompts pad to it (a few positions of work)
# rather than each power of two below it costing a program of its own.
BUCKET_FLOOR = 16


class StaticCacheGenerator:
    """Decoding (greedy or sampled) with a causal LM in the static-cache style: ``forward(input_ids, cache_position)``
    returns logits ``[batch, tokens, vocab]`` and writes each layer's keys and values into cache buffers of
    ``max_length`` positions at ``cache_position`` (``index_copy_``), its attention masked by the positions.

    `prefill` and `decode` run the forward for the prompt and for one token (optimized modules from
    `StaticCacheGenerator.optimize`, or any callables of that signature; default: the model itself). Both
    update the same cache. `buckets` (length -> a callable ``(input_ids, cache_position, last) -> logits at
    last``) prefill a prompt of n tokens with the smallest bucket >= n, right-padded, the logits taken at
    n - 1 (exact for a causal model: docs/decode.md); `prefill` runs the prompts no bucket takes. The
    generator keeps the position: `prefill` starts a sequence at 0, `step` appends one token, `generate` does
    both; a sequence past `max_length` is refused before anything runs. Fewer sequences than `batch_size` run
    with dummy rows and come back alone. `caches`: the cache tensors `reset()` zeroes (the programs' states
    where the generator built them). `prefill_module`, `prefill_buckets` and `decode_module` are what runs (an
    OptimizedModule's `.report` says what it does)."""

    def __init__(self, model: torch.nn.Module, *, max_length: int, batch_size: int | None = None,
                 prefill: Step | None = None, decode: Step | None = None, caches: Sequence[torch.Tensor] = (),
                 buckets: Mapping[int, BucketStep] | None = None) -> None:
        if int(max_length) < 1:
            raise InvalidArgumentError(f"max_length must be at least 1 (the cache's positions), not {max_length}")
        self.model = model
        self.max_length = int(max_length)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.prefill_module = prefill or model
        self.decode_module = decode or model
        self.prefill_buckets: dict[int, BucketStep] = {}
        for length, module in sorted((buckets or {}).items()):
            if not 1 <= int(length) <= self.max_length:
                raise InvalidArgumentError(f"a prefill bucket of {length} tokens does not fit the cache of "
                                           f"{self.max_length} positions: buckets run from 1 to max_length")
            self.prefill_buckets[int(length)] = module
        # The given caches (the programs' states) and the tensors a wrapper says its forward updates (a
        # transformers cache layer's own counters among them), which a program that fell back has no state for.
        self.caches: list[torch.Tensor] = []
        for t in [*caches, *getattr(model, "cache_tensors", list)()]:
            if all(t is not c for c in self.caches):
                self.caches.append(t)
        self.position = 0  # the next position the cache gets written at
        self._rows: int | None = None  # the sequences prefill() started (the rest of the batch: dummy rows)
        self._cache_position: torch.Tensor | None = None  # decode's one-position input, updated in place
        self._recent: list[int] = []  # buckets by last use, most recent last (working memory kept for MAX_RESIDENT)
        self._warned_longer = False

    # ---- building ----

    @classmethod
    def optimize(cls, model: torch.nn.Module, *, batch_size: int, max_length: int,
                 prompt_lengths: int | Sequence[int] | None = None, prompt_length: int | None = None,
                 device: torch.device | str | None = None, **options: Any) -> "StaticCacheGenerator":
        """Optimizes `model` with stitchcuda.optimize (`options` are its keyword arguments), at `batch_size`:
        the decode program (one token), and the prefill, built up front, one of two ways:

        - ``prompt_lengths``: a prefill program per power-of-two bucket (`bucket_lengths`: an int is the
          longest prompt, every bucket from BUCKET_FLOOR up to it; a sequence, the bucket of each length). A
          prompt of n tokens runs the smallest bucket >= n, right-padded, its logits taken at n - 1; one
          longer than every bucket runs the model itself. Exact for a model causal in the positions, which
          is checked on an example first (check_padded_prefill): another is refused, naming prompt_length=.
        - ``prompt_length``: one prefill program for prompts of exactly that length (the pair `save` writes);
          other lengths run the model itself for their prefill.

        The model's cache buffers are the programs' states: all read and update them in place."""
        if (prompt_lengths is None) == (prompt_length is None):
            raise InvalidArgumentError("pass prompt_lengths= (prefill programs for power-of-two buckets of prompt "
                                       "lengths, any prompt up to the longest) or prompt_length= (one prefill for "
                                       "prompts of exactly that length), one of the two")
        device = torch.device(device) if device is not None else _device_of(model)
        if prompt_length is not None:
            _check_prompt(prompt_length, max_length, "prompt_length")
            ids = torch.zeros(batch_size, prompt_length, dtype=torch.long, device=device)
            prefill = optimize(model, (ids, torch.arange(prompt_length, device=device)), **options)
            buckets: dict[int, Any] = {}
            first = int(prompt_length)
        else:
            lengths = bucket_lengths(prompt_lengths, max_length)
            why = model.padding_refusal() if isinstance(model, TransformersStaticCacheLM) else ""
            if why:
                raise InvalidArgumentError(f"prefill buckets pad a prompt, which is not exact for this model: {why}; "
                                           "build with prompt_length= (one prefill for an exact prompt length)")
            at_last = prefill_model(model)
            check_padded_prefill(model, at_last, lengths, batch_size=batch_size, max_length=max_length,
                                 device=device)
            prefill, buckets = model, {}
            for length in lengths:
                example = (torch.zeros(batch_size, length, dtype=torch.long, device=device),
                           torch.arange(length, device=device), torch.tensor([length - 1], device=device))
                buckets[length] = optimize(at_last, example, **options)
                _release(buckets[length])  # its working memory comes back at its first prompt
            first = lengths[0]
        one = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        decode = optimize(model, (one, torch.tensor([min(first, max_length - 1)], device=device)), **options)
        caches = [*_states_of(prefill), *(t for m in buckets.values() for t in _states_of(m)), *_states_of(decode)]
        generator = cls(model, max_length=max_length, batch_size=batch_size, prefill=prefill, decode=decode,
                        caches=caches, buckets=buckets)
        generator.reset()  # optimize() ran the forward on its example and check inputs
        return generator

    @classmethod
    def for_transformers(cls, model: torch.nn.Module, *, batch_size: int, max_length: int,
                         prompt_lengths: int | Sequence[int] | None = None, prompt_length: int | None = None,
                         **options: Any) -> "StaticCacheGenerator":
        """`optimize` for a transformers causal LM: its forward runs with a StaticCache of `max_length`
        positions whose tensors are the programs' states (TransformersStaticCacheLM)."""
        return cls.optimize(TransformersStaticCacheLM(model, batch_size=batch_size, max_length=max_length),
                            batch_size=batch_size, max_length=max_length, prompt_lengths=prompt_lengths,
                            prompt_length=prompt_length, **options)

    # ---- saving ----

    def save(self, path: str | os.PathLike) -> None:
        """Writes the prefill and decode programs as one file (their weights once, the cache as their paired
        states, ``max_length``): ``stitchcuda.load(path)`` runs its token loop in C++, as does
        ``torch::Generator::load`` and ``serve generate`` without Python (docs/decode.md). The file holds one
        prefill, for prompts of exactly its length: a generator built with ``prompt_length=`` (its prefill
        program is the one written); one with prefill buckets is refused. Both modules must run programs (an
        OptimizedModule whose report.status is 'optimized'), over the same cache tensors."""
        from ..program import DecodePrograms, Program

        if self.prefill_buckets:
            lengths = ", ".join(str(n) for n in self.prefill_buckets)
            raise InvalidArgumentError(
                f"this generator prefills through {len(self.prefill_buckets)} bucket(s) of {lengths} tokens (a prompt "
                "right-padded, its last position an input) and a saved pair holds one prefill for prompts of exactly "
                "its length: build the generator to save with StaticCacheGenerator.optimize(..., prompt_length=N), N "
                "the length C++ will be given")
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
        # The file pairs states by name; where both programs read a model's tensor, it must be the same memory
        # (not necessarily the same Python object: a build may hold its own view of the buffer).
        names = [{b["id"]: b["name"] for b in p.buffers if b["role"] == "state"} for p in programs]
        for mine, theirs in pair.state_pairs:
            a, b = programs[0].shared_weights.get(mine), programs[1].shared_weights.get(theirs)
            if a is not None and b is not None and not _same_memory(a, b):
                raise InvalidArgumentError(f"the prefill's state '{names[0][mine]}' and the decode's are different "
                                           "tensors: build both programs from one model (StaticCacheGenerator.optimize)")
        pair.save(path)
        log.info("saved %s: the prefill for prompts of exactly %d tokens and the decode step, batch %d",
                 path, pair.prompt_length, pair.batch_size)

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

    def _full_batch(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` [rows, tokens] with dummy rows (copies of the first) up to the cache's batch: rows are
        independent (each has its own cache rows and attention), so the dummies change no real row."""
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"input_ids must be a [batch, tokens] integer tensor, not {ids.dtype}"
                                       f"{list(ids.shape)}")
        rows = ids.shape[0]
        if self.batch_size is None or rows == self.batch_size:
            return ids
        if rows > self.batch_size or rows == 0:
            raise InvalidArgumentError(f"input_ids hold a batch of {rows} but the cache was built for {self.batch_size}: "
                                       f"pass 1 to {self.batch_size} sequences (fewer run beside dummy rows), split the "
                                       f"batch, or build a generator with batch_size={max(rows, 1)}")
        return torch.cat([ids, ids[:1].expand(self.batch_size - rows, -1)])

    def _bucket_for(self, tokens: int) -> int | None:
        return next((length for length in self.prefill_buckets if length >= tokens), None)

    # ---- running ----

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Starts a sequence with the prompts `input_ids` [rows, tokens] (rows up to the batch): writes
        positions 0..tokens-1 of the cache and returns the logits of the prompt's last token, [rows, vocab]."""
        rows = input_ids.shape[0] if input_ids.dim() == 2 else 0
        logits = self._prefill(self._full_batch(input_ids))
        self._rows = rows
        return logits[:rows]

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = ids.shape[1]
        self.position = 0
        self._reserve(tokens, f"a prompt of {tokens} tokens")
        # A new sequence starts from zeroed caches: a cache that counts its own writes (a transformers 5
        # StaticCache layer's cumulative_length) would otherwise append after the last sequence.
        self.reset()
        bucket = self._bucket_for(tokens)
        if bucket is None:
            if self.prefill_buckets and not self._warned_longer:
                self._warned_longer = True
                log.warning("a prompt of %d tokens is longer than the largest prefill bucket (%d): the model itself "
                            "prefills it (optimize with prompt_lengths= up to the longest prompt for a program)",
                            tokens, max(self.prefill_buckets))
            logits = self.prefill_module(ids, torch.arange(tokens, device=ids.device))
        else:
            # Positions tokens..bucket-1 get the padding's keys and values; a step at position p writes p
            # before its attention reads it, and reads positions <= p only, so no step reads them.
            padded = torch.cat([ids, ids[:, -1:].expand(-1, bucket - tokens)], dim=1) if bucket > tokens else ids
            last = torch.tensor([tokens - 1], device=ids.device)
            logits = self.prefill_buckets[bucket](padded, torch.arange(bucket, device=ids.device), last)
            set_length = getattr(self.model, "set_length", None)
            if set_length is not None and bucket > tokens:
                set_length(tokens)  # a cache counting its own writes continues at the prompt's end
            self._keep_resident(bucket)
        self.position = tokens
        return logits[:, -1]

    def _keep_resident(self, bucket: int) -> None:
        """The MAX_RESIDENT buckets used last keep their working memory (arena, captured graph); the
        others give it back until their next prompt."""
        self._recent = [b for b in self._recent if b != bucket] + [bucket]
        for old in self._recent[:-MAX_RESIDENT]:
            _release(self.prefill_buckets[old])
        self._recent = self._recent[-MAX_RESIDENT:]

    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Appends one token per sequence (`token_ids` [rows] or [rows, 1], the rows prefill() started) at
        the current position and returns the next logits, [rows, vocab]."""
        ids = token_ids.reshape(-1, 1)
        if self._rows is not None and ids.shape[0] != self._rows:
            raise InvalidArgumentError(f"step() got {ids.shape[0]} tokens but prefill() started {self._rows} "
                                       "sequences: pass one token per sequence")
        return self._step(self._full_batch(ids))[:ids.shape[0]]

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.position == 0:
            raise InvalidArgumentError("step() continues a sequence: call prefill() with the prompt first")
        self._reserve(1, "one more token")
        if self._cache_position is None or self._cache_position.device != ids.device:
            self._cache_position = torch.zeros(1, dtype=torch.long, device=ids.device)
        self._cache_position.fill_(self.position)  # on the device: the loop never waits for the host
        logits = self.decode_module(ids, self._cache_position)
        self.position += 1
        return logits[:, -1]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None, *,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """The prompts `input_ids` [rows, tokens] (rows up to the batch) followed by `max_new_tokens` new
        tokens each, [rows, tokens + max_new_tokens]: greedy (the argmax) by default; with ``do_sample=True``
        drawn on the device from the logits divided by `temperature`, cut to the `top_k` likeliest and to the
        smallest set whose probability reaches `top_p` (`next_tokens`), from `generator` (a torch.Generator
        of the model's device: the same seed, the same tokens). With `eos_token_id`, a sequence that has
        produced it repeats it, and the result ends where every sequence has (fewer columns). The whole
        sequence must fit the cache, and the arguments must be valid: both checked before anything runs."""
        if isinstance(max_new_tokens, bool) or int(max_new_tokens) < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        check_sampling(do_sample, temperature, top_k, top_p, eos_token_id)
        ids = self._full_batch(input_ids)
        rows = input_ids.shape[0]
        if do_sample and generator is not None:
            _check_generator(generator, ids.device)
        self.position = 0
        # The last new token is never written to the cache: the prompt and max_new_tokens - 1 are.
        self._reserve(ids.shape[1] + max_new_tokens - 1,
                      f"a prompt of {ids.shape[1]} tokens and {max_new_tokens} new ones")

        def choose(logits: torch.Tensor) -> torch.Tensor:
            return next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=generator)

        token = choose(self._prefill(ids))
        self._rows = rows
        new = [token]
        done = None
        if eos_token_id is not None:  # the dummy rows count as done: only real rows keep the loop going
            done = (token == eos_token_id) | (torch.arange(len(token), device=token.device) >= rows)
            eos = torch.full_like(token, eos_token_id)
        for i in range(1, int(max_new_tokens)):
            # `done` stays on the device and is read every EOS_CHECK_EVERY tokens: a read waits for every
            # step queued before it, and a read per token would keep the host from queueing ahead. The
            # steps past the end are trimmed below (a finished row repeats eos, so the end is exact).
            if done is not None and i % EOS_CHECK_EVERY == 0 and bool(done.all()):
                break
            token = choose(self._step(token[:, None]))
            if done is not None:
                token = torch.where(done, eos, token)
                done |= token == eos
            new.append(token)
        tokens = torch.stack(new, dim=1)[:rows]
        if done is not None:
            tokens = tokens[:, :_until_all_ended(tokens, eos_token_id)]
        return torch.cat([ids[:rows], tokens], dim=1)


# How many new tokens generate() queues between two reads of its eos flags on the host: each read drains
# the queue (the device then idles while the next step is launched); 16 makes that wait 1/16 of the steps'
# and generates at most 15 steps past the last sequence's end.
EOS_CHECK_EVERY = 16


def _until_all_ended(tokens: torch.Tensor, eos_token_id: int) -> int:
    """How many columns of `tokens` [rows, new] run up to the first where every row shows eos (a finished
    row repeats it, so that column is where the last row ended), or all of them."""
    ended = (tokens == eos_token_id).all(0).nonzero()
    return int(ended[0]) + 1 if len(ended) else tokens.shape[1]


def check_sampling(do_sample: bool, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   eos_token_id: int | None = None) -> None:
    """InvalidArgumentError naming the value and the fix where generate()'s arguments choosing the tokens are
    unusable (the rules the C++ Generator's SamplingOptions follow too)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)
                                     or eos_token_id < 0):
        raise InvalidArgumentError(f"eos_token_id is one token id (an int >= 0) or None, not {eos_token_id!r}")

    if not number(temperature) or not math.isfinite(temperature):
        raise InvalidArgumentError(f"temperature must be a finite number (the logits are divided by it), not "
                                   f"{temperature!r}")
    if not do_sample:
        if temperature != 1.0 or top_k is not None or top_p is not None:
            raise InvalidArgumentError("temperature, top_k and top_p shape sampling, and do_sample=False decodes "
                                       "greedily (the argmax of the logits): pass do_sample=True to sample, or leave "
                                       "them out")
        return
    if temperature == 0:
        raise InvalidArgumentError("do_sample=True with a temperature of 0 is greedy decoding: pass do_sample=False "
                                   "(the argmax), or a temperature above 0 to sample")
    if temperature < 0:
        raise InvalidArgumentError(f"temperature must be above 0 (the logits are divided by it), not {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InvalidArgumentError(f"top_k must be an int >= 1 (sample among the k likeliest tokens) or None "
                                   f"(all), not {top_k!r}")
    if top_p is not None and (not number(top_p) or not 0 < top_p <= 1):
        raise InvalidArgumentError(f"top_p must be a number in (0, 1] (sample among the fewest likeliest tokens "
                                   f"whose probability reaches it) or None (all), not {top_p!r}")


def _check_generator(generator: Any, device: torch.device) -> None:
    if not isinstance(generator, torch.Generator):
        raise InvalidArgumentError(f"generator must be a torch.Generator, not {type(generator).__name__}")
    if generator.device.type != device.type:
        raise InvalidArgumentError(f"the generator is on {generator.device} but the tokens are on {device}: "
                                   f"draw from torch.Generator(device='{device.type}')")


def next_tokens(logits: torch.Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of `logits` [rows, vocab], int64 [rows], on the logits' device with no
    host sync: the argmax, or with `do_sample` a draw (torch.multinomial from `generator`) from the softmax
    of the logits / `temperature` in fp32, those below the `top_k`-th largest (ties kept) and those past the
    smallest set of the likeliest whose probability reaches `top_p` set to -inf first. The C++ Generator
    runs the same operations in the same order: seeded alike, both draw the same tokens."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # A token is dropped where the likelier ones already reach top_p: the likeliest always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator)[:, 0]

def bucket_lengths(prompt_lengths: int | Sequence[int], max_length: int) -> list[int]:
    """The prefill buckets serving `prompt_lengths`, ascending: for an int (the longest prompt) every power
    of two from BUCKET_FLOOR up to the first >= it; for a sequence of lengths, the power of two >= each.
    A bucket never passes `max_length` (the last is capped at it): at most log2(max_length) + 1 of them."""
    if isinstance(prompt_lengths, bool) or not isinstance(prompt_lengths, (int, Sequence)):
        raise InvalidArgumentError(f"prompt_lengths is the longest prompt (an int) or the prompt lengths to serve "
                                   f"(a sequence of ints), not {prompt_lengths!r}")
    if isinstance(prompt_lengths, int):
        _check_prompt(prompt_lengths, max_length, "prompt_lengths")
        wanted, length = [], BUCKET_FLOOR
        while True:
            wanted.append(length)
            if length >= prompt_lengths:
                break
            length *= 2
    else:
        if not prompt_lengths:
            raise InvalidArgumentError("prompt_lengths is empty: name at least one prompt length")
        for n in prompt_lengths:
            _check_prompt(n, max_length, "each of prompt_lengths")
        wanted = [1 << (int(n) - 1).bit_length() for n in prompt_lengths]
    return sorted({min(n, int(max_length)) for n in wanted})


def _check_prompt(n: Any, max_length: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < int(max_length):
        raise InvalidArgumentError(f"{what} must be at least 1 and below max_length ({max_length}) so that a token "
                                   f"can follow it, not {n!r}")


def _release(module: Any) -> None:
    release = getattr(module, "release", None)
    if callable(release):
        release()


class LastPositionLogits(torch.nn.Module):
    """A static-cache LM ``forward(input_ids, cache_position) -> logits [batch, tokens, vocab]`` as a padded
    prefill: ``forward(input_ids, cache_position, last) -> logits [batch, 1, vocab]`` at position `last` (a
    one-element index tensor, an input of the program: one program serves every prompt of its bucket).
    Captured, the index moves above the LM head and final norm (graph/hoist_index.py), so the program's head
    runs on one row per sequence, not on every position of the bucket."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.training = model.training
        self._stitchcuda_name = f"{type(model).__name__} (prefill at the last prompt position)"

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, cache_position).index_select(1, last)


def prefill_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module a bucket's prefill program is built from: ``(input_ids, cache_position, last) -> logits at
    last``. A TransformersStaticCacheLM takes `last` itself (its LM head reads that position's hidden state
    alone); another model's logits are indexed (LastPositionLogits)."""
    return model if isinstance(model, TransformersStaticCacheLM) else LastPositionLogits(model)


def check_padded_prefill(model: torch.nn.Module, at_last: Any, buckets: Sequence[int], *, batch_size: int,
                         max_length: int, device: torch.device | None = None, steps: int = 3) -> None:
    """Checks, with the model itself, that a prefill padded to its bucket is exact: a prompt of half the
    smallest bucket of two tokens or more, then `steps` greedy tokens, once prefilled at its length and once
    through `at_last` (right-padded, the logits at its last position, the next tokens fed the same), the
    logits alike within rounding. A model whose attention reads positions after the query's (its mask not
    causal in the positions), or whose logits at a position depend on the call's length, fails it:
    InvalidArgumentError naming prompt_length=, the exact-length prefill, as the way to build it."""
    bucket = next((b for b in buckets if b >= 2), None)
    if bucket is None:
        return  # buckets of one token: a prompt is never padded
    device = device or _device_of(model)
    tokens = bucket // 2
    steps = max(0, min(steps, max_length - tokens))
    vocab = _vocab_of(model)
    ids = torch.randint(0, vocab, (batch_size, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    probe = StaticCacheGenerator(model, max_length=max_length, batch_size=batch_size)
    with torch.no_grad():
        exact, chosen = _forced_logits(probe, ids, steps)
        probe.prefill_buckets = {bucket: at_last}
        padded, _ = _forced_logits(probe, ids, steps, chosen)
        probe.reset()
    scale = float(exact.abs().max()) or 1.0
    error = float((padded.float() - exact.float()).abs().max())
    tol = 1e-3 if exact.dtype in (torch.float32, torch.float64) else 5e-2
    if not error <= tol * scale:  # NaN fails too
        raise InvalidArgumentError(
            f"{type(model).__name__} is not exact under a padded prefill: a prompt of {tokens} tokens padded to "
            f"{bucket} gives logits {error:.3g} away from its exact-length prefill's (max |logit| {scale:.3g}) over "
            f"the prompt and {steps} tokens after it. Padding is exact only where a token attends to the positions up "
            "to its own (the mask from cache_position) and its logits come from its own hidden state: build this "
            "model's generator with prompt_length= (one prefill for an exact prompt length)")


def _forced_logits(gen: StaticCacheGenerator, ids: torch.Tensor, steps: int,
                   tokens: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prefill's logits and `steps` steps' after it, stacked; the tokens fed are the greedy ones, or
    `tokens` (the same inputs for two runs that are compared)."""
    logits = [gen.prefill(ids)]
    chosen = []
    for k in range(steps):
        token = logits[-1].argmax(-1) if tokens is None else tokens[k]
        chosen.append(token)
        logits.append(gen.step(token))
    return torch.stack(logits), chosen


def _vocab_of(model: torch.nn.Module) -> int:
    """The token ids a model takes: its transformers config's vocabulary, or its first embedding's rows."""
    config = getattr(getattr(model, "model", None), "config", None)
    if isinstance(model, TransformersStaticCacheLM) and config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(text.vocab_size)
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return int(embedding.num_embeddings) if embedding is not None else 2


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two tensors over the same elements: one device, address, dtype, shape and strides."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


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
    traces their updates as buffer mutations (program states) and the programs update these very tensors.
    ``forward(input_ids, cache_position, last)`` is a padded prefill's: the logits at position `last` alone."""

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
        self._cache_argument = _cache_argument(model)
        # Generation reads the last position's logits only: the LM head over the whole prompt would be a
        # [batch, prompt, vocab] product (8.4 GB in fp32 at 32 x 2,048 x 32,000) nobody reads.
        accepted = inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._places = _cache_tensors(cache)  # buffer name -> where the cache keeps that tensor
        for name, place in self._places.items():
            self.register_buffer(name, _get(place), persistent=False)
        # A layer's write counters (transformers 5's cumulative_length): set_length moves them.
        self._counters = [name for name, (_, key) in self._places.items()
                          if key not in ("keys", "values") and not getattr(self, name).is_floating_point()]

    def cache_tensors(self) -> list[torch.Tensor]:
        """The tensors the forward updates: the cache's keys and values and a layer's own counters."""
        return [getattr(self, name) for name in self._places]

    def set_length(self, length: int) -> None:
        """The cache holds `length` positions of the sequence: a layer that writes where its own counter
        says (transformers 5's StaticLayer: at cumulative_length, not at cache_position) writes the next
        token at `length`. After a prefill padded past the prompt, the next step overwrites the padding."""
        for name in self._counters:
            getattr(self, name).fill_(length)

    def padding_refusal(self) -> str:
        """Why a prefill padded past the prompt would not be exact over this cache ("" when it is): a
        layer other than a plain static one (a sliding window's ring would drop real positions for the
        padding's, a linear-attention layer's recurrent state would run through the padding)."""
        for i, layer in enumerate(getattr(self.cache, "layers", None) or []):
            if type(layer).__name__ != "StaticLayer" or getattr(layer, "is_sliding", False):
                return (f"the cache's layer {i} is a {type(layer).__name__}, whose state the padding would change "
                        "(only StaticLayer writes at a position that a later step overwrites)")
        return ""

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor,
                last: torch.Tensor | None = None) -> torch.Tensor:
        for name, place in self._places.items():
            _set(place, getattr(self, name))
        # A layer that writes at its own counter (transformers 5's cumulative_length, advanced by every
        # update) starts each call at cache_position: a call is then a function of its inputs, as the
        # program's replays, optimize()'s verification and timing runs need (run after run from a counter
        # left where the last call put it, the writes walk past the cache: an index out of bounds).
        for name in self._counters:
            getattr(self, name).copy_(cache_position[0])
        if last is None:
            out = self.model(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                             **{self._cache_argument: self.cache}, **self._last_only)
            return out.logits
        # The LM head over the hidden state at `last` alone: [batch, 1, vocab], never the bucket's
        # [batch, bucket, vocab] (the padded prefill's check compares these logits with the model's own).
        base, head = getattr(self.model, "base_model", None), self.model.get_output_embeddings()
        if base is None or base is self.model or head is None:
            out = self.model(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                             **{self._cache_argument: self.cache})
            return out.logits.index_select(1, last)
        hidden = base(input_ids=input_ids, cache_position=cache_position, use_cache=True,
                      **{_cache_argument(base): self.cache}).last_hidden_state
        return head(hidden.index_select(1, last))


def _cache_argument(model: torch.nn.Module) -> str:
    """The keyword a transformers forward takes its cache by: `cache` from 5.25, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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
