"""RULER-style synthetic long-context tasks (Hsieh et al., 2024), generated offline.

    niah_single      one needle "One of the special magic numbers for KEY is: VALUE."
    niah_multikey    the same, among 3 distractor needles with other keys
    niah_multivalue  one key with 4 values; all 4 must be returned
    niah_multiquery  4 keys asked at once; all 4 values must be returned
    vt               variable tracking: VAR A = 12345. VAR B = VAR A. ... (4 hops) in noise,
                     after one solved example; all 5 names bound to the value
    cwe              common words: a numbered list where 5 words make up ~30% of entries and
                     the others appear 3 times each; return the 5 common ones
    fwe              frequent words: coded words with Zipf frequencies (alpha 2, the top rank
                     is the noise word '....'); return ranks 2-4
    passkey          passkey retrieval: one 5-digit pass key stated in RULER's noise, asked
                     at the end (the simplest retrieval a long-context server must keep)

A sample is drawn from ``random.Random(f"{task}/{num_tokens}/{seed}")``, so it depends on
nothing else. The context grows in units (haystack sentences, list entries, words) until
the chat-formatted prompt, answer prefix included, is as long as the target without
passing it (binary search on the unit count, counting with the model's tokenizer).

A prompt is the user turn (instructions, context, then the question) through the model's
chat template (a base model without one: as plain text), followed by the start of the
assistant's answer, as RULER does. Score
(RULER's string match, case-insensitive): ``all`` is the fraction of expected answers found
in the output, ``part`` is 1 when any is found; every task here uses ``all``.
"""

from __future__ import annotations

import math
import random
import string
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from spin_cluster.profiling import haystack


@dataclass(frozen=True)
class Rendered:
    """A task instance at one context size, before tokenization."""

    text: str  # the user turn: instructions, context, question
    answer_prefix: str  # the start of the assistant's turn
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    task: str
    seed: int
    target_tokens: int  # the prompt was fitted to at most this many tokens
    text: str
    answer_prefix: str
    answers: tuple[str, ...]
    metric: str  # "all" or "part"
    prompt_ids: tuple[int, ...]  # chat template + answer prefix: what the engine is given

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    def score(self, output: str) -> float:
        return score(output, self.answers, self.metric)


# ---- scoring ----------------------------------------------------------------------------------


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` that occur in ``output`` (case-insensitive)."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """1.0 when any of ``answers`` occurs in ``output`` (case-insensitive), else 0.0."""
    out = output.lower()
    return float(any(a.lower() in out for a in answers))


_METRICS = {"all": string_match_all, "part": string_match_part}


def score(output: str, answers: Sequence[str], metric: str) -> float:
    if metric not in _METRICS:
        raise ValueError(f"metric {metric!r}: choose one of {', '.join(_METRICS)}")
    return _METRICS[metric](output, answers)


# ---- tasks ------------------------------------------------------------------------------------


class Task(ABC):
    """One task family. ``render`` must be deterministic in (rng state, size) and grow
    (roughly monotonically) with ``size``, the number of context units."""

    name: ClassVar[str]
    metric: ClassVar[str] = "all"

    @abstractmethod
    def render(self, rng: random.Random, size: int) -> Rendered: ...

    def max_size(self) -> int | None:
        """Most context units this task can make; None: no limit."""
        return None


_TASKS: dict[str, Task] = {}


def _register(cls: type[Task]) -> type[Task]:
    _TASKS[cls.name] = cls()
    return cls


def task_names() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(_TASKS)}") from None


class _Needles(Task):
    """Needles "One of the special magic numbers for KEY is: VALUE." hidden at random depths
    in ``size`` sentences of filler. ``num_keys`` keys (the first ``num_queries`` are asked
    for), ``num_values`` values per key; values are 7-digit numbers, keys word pairs."""

    num_keys: ClassVar[int] = 1
    num_values: ClassVar[int] = 1
    num_queries: ClassVar[int] = 1
    filler: ClassVar[str] = "docs"

    def render(self, rng, size):
        pool = haystack.words()
        keys = []
        while len(keys) < self.num_keys:
            key = f"{rng.choice(pool)}-{rng.choice(pool)}"
            if key not in keys:
                keys.append(key)
        values = rng.sample(range(1_000_000, 10_000_000), self.num_keys * self.num_values)
        needles = [
            (f"One of the special magic numbers for {k} is: {values[i * self.num_values + j]}.", rng.random())
            for i, k in enumerate(keys) for j in range(self.num_values)
        ]
        start = rng.randrange(len(haystack.sentences(self.filler)))
        context = _insert(haystack.run_of_sentences(self.filler, start, size), needles)
        asked = keys[: self.num_queries]
        answers = tuple(str(v) for v in values[: self.num_queries * self.num_values])  # key-major
        if len(answers) == 1:
            question = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
            prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
        else:
            names = _join(asked)
            question = f"What are all the special magic numbers for {names} mentioned in the provided text?"
            prefix = f"The special magic numbers for {names} mentioned in the provided text are"
        text = (
            "Some special magic numbers are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the numbers afterwards.\n"
            f"{context}\n{question}"
        )
        return Rendered(text, prefix, answers)


@_register
class NiahSingle(_Needles):
    name = "niah_single"


@_register
class NiahMultiKey(_Needles):
    name = "niah_multikey"
    num_keys = 4


@_register
class NiahMultiValue(_Needles):
    name = "niah_multivalue"
    num_values = 4


@_register
class NiahMultiQuery(_Needles):
    name = "niah_multiquery"
    num_keys = 4
    num_queries = 4


@_register
class Passkey(Task):
    """One 5-digit pass key, stated twice in one sentence pair at a random depth of ``size``
    noise sentences; the answer is the key."""

    name = "passkey"

    def render(self, rng, size):
        key = str(rng.randrange(10_000, 100_000))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        context = _insert(haystack.run_of_sentences("noise", 0, size), [(needle, rng.random())])
        text = (
            "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the pass key.\n"
            f"{context}\nWhat is the pass key?"
        )
        return Rendered(text, "The pass key is", (key,))


@_register
class VariableTracking(Task):
    """One chain of ``num_hops`` assignments, spread in order through RULER's noise, after a
    solved example instance (as RULER's template has; other names, other value)."""

    name = "vt"
    num_hops = 4
    # RULER shows one solved instance first; its context, in noise sentences.
    example_size = 20

    def render(self, rng, size):
        example = self._instance(rng, self.example_size, avoid=())
        task = self._instance(rng, size, avoid=example.answers)
        shot = f"{example.text} {example.answer_prefix} {' '.join(example.answers)}\n\n"
        return Rendered(shot + task.text, task.answer_prefix, task.answers)

    def _instance(self, rng, size, avoid):
        names: list[str] = []
        while len(names) < self.num_hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names and name not in avoid:
                names.append(name)
        value = rng.randrange(10_000, 100_000)
        depths = sorted(rng.random() for _ in names)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        context = _insert(haystack.run_of_sentences("noise", 0, size), list(zip(chain, depths)))
        text = (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            f"{context}\nQuestion: Find all variables that are assigned the value {value} in the text above."
        )
        prefix = (
            f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} "
            f"variables are assigned the value {value}, they are:"
        )
        return Rendered(text, prefix, tuple(names))


@_register
class CommonWords(Task):
    """A numbered list of ``size`` entries: ``num_common`` words share ``common_share`` of the
    entries, every other word appears ``uncommon_count`` times (the last one maybe fewer)."""

    name = "cwe"
    num_common = 5
    common_share = 0.3
    uncommon_count = 3

    def render(self, rng, size):
        pool = list(haystack.words())
        rng.shuffle(pool)
        common, rest = pool[: self.num_common], pool[self.num_common :]
        per_common = max(self.uncommon_count + 2, round(self.common_share * size / self.num_common))
        entries = [w for w in common for _ in range(per_common)]
        for word in rest:
            if len(entries) >= size:
                break
            entries.extend([word] * min(self.uncommon_count, size - len(entries)))
        rng.shuffle(entries)
        listing = "\n".join(f"{i}. {w}" for i, w in enumerate(entries, 1))
        k = self.num_common
        text = (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            f"Memorize the ones that appear most often.\n{listing}\n"
            f"Question: What are the {k} most common words in the above list?"
        )
        return Rendered(text, f"Answer: The top {k} words that appear most often in the list are:", tuple(common))

    def max_size(self):
        # Past this the uncommon words run out (~19K tokens of SmolLM2's tokenizer).
        num_uncommon = len(haystack.words()) - self.num_common
        return int(num_uncommon * self.uncommon_count / (1 - self.common_share))


@_register
class FrequentWords(Task):
    """About ``size`` draws of 6-letter coded words: the word of rank r appears
    floor(size * r^-alpha / zeta(alpha)) times, rank 1 being the noise word '....' (RULER's
    fwe). The answers are ranks 2-4."""

    name = "fwe"
    alpha = 2.0
    word_len = 6
    num_answers = 3

    def render(self, rng, size):
        counts = []
        rank = 1
        while rank == 1 or counts[-1] > 0:
            counts.append(int(size * rank**-self.alpha / _zeta(self.alpha)))
            rank += 1
        vocab = ["...."]
        while len(vocab) < max(len(counts), 1 + self.num_answers):
            word = "".join(rng.choices(string.ascii_lowercase, k=self.word_len))
            if word not in vocab:
                vocab.append(word)
        draws = [w for w, n in zip(vocab, counts) for _ in range(n)]
        rng.shuffle(draws)
        text = (
            "Read the following coded text and track the frequency of each coded word. Find the "
            f"three most frequently appeared coded words. {' '.join(draws)}\n"
            "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
            "three most frequently appeared words in the above coded text?"
        )
        prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
        return Rendered(text, prefix, tuple(vocab[1 : 1 + self.num_answers]))


def _zeta(alpha: float) -> float:
    if alpha == 2.0:
        return math.pi**2 / 6
    return sum(k**-alpha for k in range(1, 100_000))


def _insert(sentences: list[str], items: list[tuple[str, float]]) -> str:
    """Put each (text, depth in [0, 1]) between sentences, at round(depth * len) sentences
    from the start; ties keep the items' order."""
    slots: list[list[str]] = [[] for _ in range(len(sentences) + 1)]
    for text, depth in items:
        slots[round(depth * len(sentences))].append(text)
    parts = []
    for i, slot in enumerate(slots):
        parts.extend(slot)
        if i < len(sentences):
            parts.append(sentences[i])
    return " ".join(parts)


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


# ---- prompts ----------------------------------------------------------------------------------


def prompt_ids(tokenizer, rendered: Rendered) -> list[int]:
    """The user turn through the chat template, then the answer prefix as plain text. A base
    model (its folder has no chat template: Gemma-3-270M) is prompted as RULER prompts base
    models: the user turn as plain text (with the tokenizer's BOS), a line break, the prefix."""
    if not tokenizer.has_chat_template():
        return tokenizer.encode(rendered.text + "\n") + plain_ids(tokenizer, rendered.answer_prefix)
    ids = tokenizer.chat_prompt_ids([{"role": "user", "content": rendered.text}])
    return ids + plain_ids(tokenizer, rendered.answer_prefix)


def plain_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids without the special tokens the tokenizer adds around any text."""
    around = tokenizer.encode("")  # e.g. [BOS] for Llama 3, [] for SmolLM2
    ids = tokenizer.encode(text)
    if around and ids[: len(around)] == around:
        ids = ids[len(around) :]
    return ids


# A task that cannot grow further may fall this far short of the target, no more.
_SHORT_OF_TARGET = 0.95


def make_sample(task: str, tokenizer, num_tokens: int, seed: int = 0) -> Sample:
    """A sample of ``task`` whose prompt has at most ``num_tokens`` tokens, as close to it as
    the task's unit allows. ``tokenizer``: ``spin_cluster.tokenizer.Tokenizer`` (or anything
    with ``encode``, ``has_chat_template`` and ``chat_prompt_ids``)."""
    spec = get_task(task)
    key = f"{task}/{num_tokens}/{seed}"

    def build(size: int) -> tuple[Rendered, list[int]]:
        rendered = spec.render(random.Random(key), size)
        return rendered, prompt_ids(tokenizer, rendered)

    size = _largest_fitting(lambda n: len(build(n)[1]) <= num_tokens, spec.max_size())
    if size is None:
        raise ValueError(
            f"task {task!r} needs more than {num_tokens} prompt tokens even with an empty "
            f"context ({len(build(0)[1])}); give a longer length"
        )
    rendered, ids = build(size)
    if size == spec.max_size() and len(ids) < _SHORT_OF_TARGET * num_tokens:
        raise ValueError(
            f"task {task!r} makes at most {len(ids)} prompt tokens, short of {num_tokens}; "
            f"give a shorter length"
        )
    return Sample(task, seed, num_tokens, rendered.text, rendered.answer_prefix, rendered.answers,
                  spec.metric, tuple(ids))


def _largest_fitting(fits, limit: int | None) -> int | None:
    """Largest n in [0, limit] with fits(n), assuming fits is (roughly) monotone."""
    if not fits(0):
        return None
    lo, hi = 0, 1
    while fits(hi):  # double until too long (or at the limit)
        lo = hi
        if limit is not None and hi >= limit:
            return limit
        hi = hi * 2 if limit is None else min(hi * 2, limit)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
