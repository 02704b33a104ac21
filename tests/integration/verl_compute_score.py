"""A reward function for the built-in task written as veRL's custom reward function
documentation writes one: `compute_score(data_source, solution_str, ground_truth,
extra_info=None)` returning a float. Used unchanged by tests/integration/test_reward_forms.py."""

import re


def extract_solution(solution_str):
    match = re.search(r":\s*(-?\d+)\s*$", solution_str)
    return None if match is None else match.group(1)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if int(answer) == int(ground_truth) else 0.0
