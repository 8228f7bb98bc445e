"""The synthetic tasks: deterministic, fitted to the target length, answers in the prompt,
and exact string-match scoring."""

import re
from collections import Counter

import pytest

from spin_cluster.profiling import ruler
from spin_cluster.tokenizer import Tokenizer

TASKS = ruler.task_names()


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer(smollm2_path)


def test_all_eight_tasks_are_registered():
    assert TASKS == ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "passkey", "vt", "cwe", "fwe"]


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_sample_other_seed_other_sample(tok, task):
    a, b = ruler.make_sample(task, tok, 700, seed=3), ruler.make_sample(task, tok, 700, seed=3)
    assert a == b
    c = ruler.make_sample(task, tok, 700, seed=4)
    assert c.answers != a.answers and c.prompt_ids != a.prompt_ids


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("target", [1000, 2000])
def test_prompt_fits_the_target_within_3_percent(tok, task, target):
    s = ruler.make_sample(task, tok, target, seed=0)
    assert 0.97 * target <= s.num_tokens <= target
    assert s.prompt_ids == tuple(tok.chat_prompt_ids([{"role": "user", "content": s.text}])) + s.prompt_ids[-len(
        ruler.plain_ids(tok, s.answer_prefix)):]


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_is_in_the_context_and_the_prompt_ends_with_the_prefix(tok, task):
    s = ruler.make_sample(task, tok, 1000, seed=1)
    assert s.answers and all(a in s.text for a in s.answers)
    assert tok.decode(list(s.prompt_ids)).endswith(s.answer_prefix)
    question = s.text.rindex("\n")  # the question is the last line, after the context
    assert all(s.text.rindex(a) < question for a in s.answers)


def test_needles_are_distinct_and_only_the_asked_keys_are_answers(tok):
    s = ruler.make_sample("niah_multikey", tok, 1000, seed=0)
    needles = re.findall(r"special magic numbers for (\S+) is: (\d{7})\.", s.text)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = re.search(r"number for (\S+) mentioned", s.text).group(1)
    assert s.answers == tuple(v for k, v in needles if k == asked)
    multi = ruler.make_sample("niah_multivalue", tok, 1000, seed=0)
    assert len(set(re.findall(r"special magic numbers for (\S+) is:", multi.text))) == 1
    assert len(multi.answers) == 4


def test_variable_chain_binds_every_answer_to_the_value(tok):
    s = ruler.make_sample("vt", tok, 1000, seed=0)
    task = s.text.split("\n\n", 2)[-1]  # after the solved example
    value = re.search(r"assigned the value (\d+) in the text above\.$", task).group(1)
    bound = {re.search(rf"VAR (\w+) = {value}\.", task).group(1)}
    for a, b in re.findall(r"VAR (\w+) = VAR (\w+)\.", task):
        if b in bound:
            bound.add(a)
    assert bound == set(s.answers) and len(bound) == 5


def test_common_words_are_the_most_frequent_entries(tok):
    s = ruler.make_sample("cwe", tok, 1500, seed=0)
    counts = Counter(re.findall(r"^\d+\. (\w+)$", s.text, flags=re.M))
    top = {w for w, _ in counts.most_common(5)}
    assert top == set(s.answers)
    assert min(counts[w] for w in s.answers) > max(n for w, n in counts.items() if w not in s.answers)


def test_frequent_words_are_ranks_two_to_four(tok):
    s = ruler.make_sample("fwe", tok, 1500, seed=0)
    context = s.text.split("coded words. ", 1)[1].split("\nQuestion")[0]
    ranked = [w for w, _ in Counter(context.split()).most_common(4)]
    assert ranked[0] == "...." and tuple(ranked[1:]) == s.answers


def test_string_match_scores():
    assert ruler.string_match_all(" 123 and 456.", ["123", "456", "789", "000"]) == 0.5
    assert ruler.string_match_all("The answer: ABCDE", ["abcde"]) == 1.0
    assert ruler.string_match_all("nothing", ["x1"]) == 0.0
    assert ruler.string_match_part("only 456", ["123", "456"]) == 1.0
    assert ruler.string_match_part("none", ["123", "456"]) == 0.0
    assert ruler.score("1234567", ["1234567"], "all") == 1.0
    with pytest.raises(ValueError, match="metric 'exact'"):
        ruler.score("x", ["x"], "exact")


def test_bad_task_and_too_short_target_say_what_to_change(tok):
    with pytest.raises(ValueError, match="unknown task 'niah'; choose one of niah_single"):
        ruler.make_sample("niah", tok, 1000)
    with pytest.raises(ValueError, match="give a longer length"):
        ruler.make_sample("niah_single", tok, 50)


def test_a_base_model_is_prompted_with_plain_text(smollm2_path, tmp_path):
    """A folder without a chat template (a base model: Gemma-3-270M) gets the user turn as
    plain text, a line break and the answer prefix, fitted to the target all the same."""
    import shutil

    shutil.copy(f"{smollm2_path}/tokenizer.json", tmp_path / "tokenizer.json")
    base = Tokenizer(str(tmp_path))
    assert not base.has_chat_template()
    s = ruler.make_sample("passkey", base, 1000, seed=0)
    assert 0.97 * 1000 <= s.num_tokens <= 1000
    prefix = ruler.plain_ids(base, s.answer_prefix)
    assert list(s.prompt_ids) == base.encode(s.text + "\n") + prefix
    assert base.decode(list(s.prompt_ids)).endswith("\n" + s.answer_prefix)
