"""A custom floe environment: prompts and answers from a JSONL (or .json / .parquet) file.

Train on it without touching floe: put this module on PYTHONPATH and name its class in a recipe:
    [env]
    name = "custom_env:QAFamily"
    options = { path = "qa.jsonl" }
"""

import difflib

from floe.envs import EnvFamily, FamilyOptions, Score, SingleTurnEnv, Task, parse_options, read_rows, select_rows


class QAOptions(FamilyOptions):
    path: str  # rows with "prompt" and "answer" columns
    instruction: str = "Answer:"


class QAFamily(EnvFamily):
    name = "qa"
    options_model = QAOptions  # lets a recipe check env.options before anything is built

    def __init__(self, **options: object) -> None:
        self.options = parse_options(QAOptions, self.name, options)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        rows = read_rows(self.options.path, ("prompt", "answer"))
        # A hash of the prompt puts each row in train or eval; the seed picks and orders them.
        return select_rows(self.name, split, count, seed, rows, key=lambda r: r["prompt"], presplit=False)

    def make_env(self, task: Task) -> SingleTurnEnv:
        answer = str(task.data["answer"])
        messages = [{"role": "user", "content": f"{self.options.instruction} {task.data['prompt']}"}]

        def score(completion: str) -> Score:  # the reward: similarity to the answer, 1.0 when exact
            reply = completion.strip()
            ratio = difflib.SequenceMatcher(None, reply, answer).ratio()
            return Score(reward=ratio, metrics={"exact": float(reply == answer)})

        return SingleTurnEnv(messages, score)
