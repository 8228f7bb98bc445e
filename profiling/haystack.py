"""Filler text and word pools for the synthetic tasks, built offline from what Python ships.

    docs    sentences of the standard library's docstrings (the modules in ``DOC_MODULES``):
            real English prose, like RULER's Paul Graham essays, with no download
    noise   RULER's repeated noise: "The grass is green. The sky is blue. ..."

Both are lists of sentences; a task takes a run of consecutive sentences (wrapping around
at the end) and puts its needles between them. The docs corpus depends on the Python
version (its docstrings), not on anything else: same interpreter, same text.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
from collections import Counter

HAYSTACKS = ("docs", "noise")

# Mostly prose-documented, pure-Python modules; ~50K tokens of sentences in Python 3.11.
DOC_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "enum",
    "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "heapq", "hmac", "html.parser", "http.client", "imaplib", "inspect",
    "io", "ipaddress", "itertools", "json", "locale", "logging", "mailbox", "mimetypes",
    "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "plistlib",
    "pprint", "queue", "random", "sched", "secrets", "selectors", "shelve", "shlex", "shutil",
    "smtplib", "socket", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing",
    "unittest", "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile",
)

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

# Words too common or too vague to be a task's key or a counted word.
_STOP_WORDS = frozenset(
    "about above after again also although another because been before being below between "
    "both cannot could does doing down during each either else even every from have having "
    "here into itself just like made make many might more most much must need never none "
    "only other over same should since some such than that their them then there these they "
    "this those through under unless until upon very well were what when where whether which "
    "while will with within without would your".split()
)
# Code-like characters: a paragraph with any of them is not prose.
_CODE_CHARS = re.compile(r"[|{}\[\]=<>_\\#@$~^]")
# Emphasis marks (*name*, ``name``) are dropped, not taken for code.
_EMPHASIS = re.compile(r"[*`]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentences(haystack: str) -> tuple[str, ...]:
    """The haystack's sentences in corpus order; ``haystack`` is one of ``HAYSTACKS``."""
    if haystack == "docs":
        return _doc_sentences()
    if haystack == "noise":
        return NOISE_SENTENCES
    raise ValueError(f"haystack {haystack!r}: choose one of {', '.join(HAYSTACKS)}")


def run_of_sentences(haystack: str, start: int, count: int) -> list[str]:
    """``count`` consecutive sentences from index ``start``, wrapping around the corpus."""
    pool = sentences(haystack)
    return [pool[(start + i) % len(pool)] for i in range(count)]


@functools.lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """Distinct plain lowercase words of the docs corpus (4-9 letters, seen at least twice,
    no stop words), sorted: the pool for needle keys and the common-words task."""
    counts = Counter(w for s in _doc_sentences() for w in re.findall(r"\b[a-z]{4,9}\b", s))
    return tuple(sorted(w for w, n in counts.items() if n >= 2 and w not in _STOP_WORDS))


@functools.lru_cache(maxsize=1)
def _doc_sentences() -> tuple[str, ...]:
    out: list[str] = []
    for paragraph in _doc_paragraphs():
        out.extend(s for s in _SENTENCE_END.split(paragraph) if len(s) >= 20)
    return tuple(out)


def _doc_paragraphs() -> list[str]:
    with warnings.catch_warnings():  # reading deprecated members' docstrings warns
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect_paragraphs()


def _collect_paragraphs() -> list[str]:
    paragraphs = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *_public_members(module)]:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(_EMPHASIS.sub("", para).split())
                if len(para) >= 60 and para.endswith(".") and ">>>" not in para and not _CODE_CHARS.search(para):
                    paragraphs.append(para)
    return paragraphs


def _public_members(module) -> list:
    """Classes and functions defined in the module itself, in name order."""
    return [
        value for key, value in sorted(vars(module).items())
        if not key.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module.__name__
    ]
