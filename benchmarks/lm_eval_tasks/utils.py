"""lm-eval hooks of the spin_ruler task: RULER's score, as profiling/ruler.py computes it."""

from spin_cluster.profiling.ruler import score


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"string_match_all": score(results[0], doc["answers"], "all")}
