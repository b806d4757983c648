"""The tools people point at an OpenAI-compatible server, against a running `fastforward serve`.

    fastforward serve --port 8000 &                     # the defaults: smollm2-135m, ar, int4
    python benchmarks/api_clients.py --url http://127.0.0.1:8000 --clients-bin /path/to/clients/bin \\
        --tokenizer ~/.cache/fastforward/models/smollm2-135m

    fastforward serve --port 8000 --quantize none --no-compile &    # for --harness: the same weights
    python benchmarks/api_clients.py ... --only lm-eval-mc --harness pretrained=smollm2-135m

The clients live in a virtual environment of their own, which this script never installs into
(`python -m venv clients && clients/bin/pip install torch==2.13.0 'guidellm==0.8.*' 'lm-eval[api]==0.4.13'
langchain-openai`); --clients-bin is its bin folder. Everything stays on loopback. Checks:

  guidellm-chat         guidellm's default chat mode (content as a list of parts, ignore_eos), --streams
                        concurrent streams for --seconds: requests completed, errored, output tokens/s
  guidellm-completions  its synthetic text completions (vLLM's ignore_eos on every request): the same
  lm-eval-mc            lm-eval `local-completions` on a multiple-choice task written to a temporary folder
                        (log-likelihoods: token-id prompts, echo, logprobs): accuracy; with --harness,
                        also `python -m fastforward.evaluation.harness` on the same task in this process's
                        environment, and the largest difference between their per-choice log-likelihoods
  lm-eval-gen           lm-eval `local-completions` on ff_arithmetic (generation, --gen-n problems)
  langchain             LangChain's ChatOpenAI: invoke, stream, batch, astream

Targets (issue 55): 0 errors in both guidellm modes; lm-eval runs both tasks; its accuracy equals the
harness's within rounding. Figures are printed and written as JSON under benchmarks/results/ with the
machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, load_average, log, machine_info

CHECKS = ("guidellm-chat", "guidellm-completions", "lm-eval-mc", "lm-eval-gen", "langchain")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# Facts a small instruct model mostly knows, each with three wrong answers (the first answer is right).
FACTS = [
    ("The capital of France is", ["Paris", "London", "Rome", "Madrid"]),
    ("The opposite of hot is", ["cold", "tall", "red", "loud"]),
    ("Two plus two equals", ["four", "seven", "nine", "one"]),
    ("The sun rises in the", ["east", "west", "north", "south"]),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"]),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "Rankine"]),
    ("The largest planet in our solar system is", ["Jupiter", "Mercury", "Mars", "Venus"]),
    ("The color of the clear sky on a sunny day is", ["blue", "green", "purple", "brown"]),
    ("A week has seven", ["days", "months", "years", "hours"]),
    ("Bees make", ["honey", "milk", "silk", "wool"]),
    ("The capital of Japan is", ["Tokyo", "Beijing", "Seoul", "Bangkok"]),
    ("The opposite of up is", ["down", "left", "over", "near"]),
    ("Ice is frozen", ["water", "sand", "oil", "glass"]),
    ("The first letter of the English alphabet is", ["A", "Z", "M", "Q"]),
    ("A triangle has three", ["sides", "wheels", "eyes", "legs"]),
    ("Fish live in", ["water", "trees", "deserts", "clouds"]),
    ("The capital of Italy is", ["Rome", "Paris", "Vienna", "Lisbon"]),
    ("The day after Monday is", ["Tuesday", "Sunday", "Friday", "Thursday"]),
    ("Cows give us", ["milk", "honey", "eggs", "silk"]),
    ("The opposite of big is", ["small", "blue", "fast", "happy"]),
]


def write_mc_task(folder: Path) -> str:
    """A multiple-choice lm-eval task over FACTS (choices shuffled with a fixed seed); its name."""
    rng = random.Random(0)
    with open(folder / "mc.jsonl", "w") as out:
        for question, answers in FACTS:
            choices = list(answers)
            rng.shuffle(choices)
            out.write(
                json.dumps({"question": question, "choices": choices, "answer": choices.index(answers[0])}) + "\n"
            )
    (folder / "ff_api_mc.yaml").write_text(
        f"""task: ff_api_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{folder / "mc.jsonl"}"
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    return "ff_api_mc"


def write_gen_task(folder: Path, n: int) -> str:
    from fastforward.evaluation.lm_eval_tasks import write_tasks

    for path in write_tasks(str(folder), n, 0, 64):
        if "humaneval" in Path(path).name:  # only ff_arithmetic (its helper would need fastforward)
            Path(path).unlink()
    return "ff_arithmetic"


def run(command: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout} s: {exc.stdout or ''}{exc.stderr or ''}"
    return code, output, round(time.perf_counter() - started, 1)


def guidellm(args: argparse.Namespace, route: str, work: Path) -> dict:
    report = work / f"guidellm{route.replace('/', '_')}.json"
    backend = f"kind=openai_http,target={args.url},model={args.model},request_format={route}"
    if args.api_key:
        backend += f",api_key={args.api_key}"
    command = [f"{args.clients_bin}/guidellm", "run", "--backend", backend]
    command += ["--profile", f"kind=concurrent,streams={args.streams}"]
    command += ["--constraint", f"kind=max_duration,seconds={args.seconds}"]
    command += ["--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32"]
    command += ["--tokenizer", f"kind=huggingface_auto,model={args.tokenizer}"]
    command += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    code, output, seconds = run(command, args.seconds + 300, OFFLINE)
    result = {"command": " ".join(command), "exit_code": code, "wall_s": seconds}
    if code != 0 or not report.exists():
        return result | {"ok": False, "output_tail": output[-2000:]}
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    tokens = bench["metrics"]["output_token_count"]["successful"]["total_sum"]
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    result |= {
        "completed": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / bench["duration"], 1) if bench["duration"] else None,
        "ttft_ms_median": round(ttft["median"], 1),
    }
    return result | {"ok": totals["errored"] == 0 and totals["successful"] > 0}


def lm_eval_command(executable: list[str], model: str, model_args: str, task: str, tasks: Path, out: Path) -> list[str]:
    command = [*executable, "--model", model, "--model_args", model_args, "--tasks", task]
    return command + ["--include_path", str(tasks), "--output_path", str(out), "--log_samples"]


def lm_eval_result(out: Path, task: str, metric: str) -> tuple[float | None, dict[str, list[float]]]:
    """The task's metric from lm-eval's results, and (a log-likelihood task's) each document's
    per-choice log-likelihoods."""
    results = sorted(out.rglob("results_*.json"))
    if not results:
        return None, {}
    figures = json.loads(results[-1].read_text())["results"][task]
    value = next((v for k, v in figures.items() if k.startswith(f"{metric},")), None)  # any filter's
    scores = {}
    for samples in out.rglob(f"samples_{task}_*.jsonl") if metric == "acc" else ():
        for line in samples.read_text().splitlines():
            sample = json.loads(line)
            # resps: per choice [[log-likelihood, is_greedy]], written as strings
            scores[str(sample["doc_id"])] = [float(r[0][0]) for r in sample["resps"]]
    return value, scores


def lm_eval(args: argparse.Namespace, work: Path, generation: bool) -> dict:
    folder = work / ("gen" if generation else "mc")
    folder.mkdir()
    task = write_gen_task(folder, args.gen_n) if generation else write_mc_task(folder)
    metric = "exact_match" if generation else "acc"
    model_args = f"model={args.model},base_url={args.url}/v1/completions,tokenizer_backend=huggingface"
    model_args += f",tokenizer={args.tokenizer},num_concurrent=2,max_retries=1"
    env = OFFLINE | ({"OPENAI_API_KEY": args.api_key} if args.api_key else {})
    command = lm_eval_command(
        [f"{args.clients_bin}/lm_eval"], "local-completions", model_args, task, folder, work / f"out-{task}"
    )
    code, output, seconds = run(command, 1800, env)
    value, scores = lm_eval_result(work / f"out-{task}", task, metric)
    result = {"command": " ".join(command), "exit_code": code, "wall_s": seconds, metric: value}
    result["ok"] = code == 0 and value is not None
    if not result["ok"]:
        result["output_tail"] = output[-2000:]
    if args.harness and not generation:
        executable = [sys.executable, "-m", "fastforward.evaluation.harness"]
        command = lm_eval_command(executable, "fastforward", args.harness, task, folder, work / "out-harness")
        code, output, seconds = run(command, 1800, OFFLINE)
        theirs, reference = lm_eval_result(work / "out-harness", task, metric)
        gaps = [abs(a - b) for doc, ours in scores.items() for a, b in zip(ours, reference.get(doc, []), strict=False)]
        result["harness"] = {
            "command": " ".join(command),
            "exit_code": code,
            "wall_s": seconds,
            metric: theirs,
            "max_loglikelihood_difference": max(gaps) if gaps else None,
            "choices_compared": len(gaps),
        }
        result["equal_to_harness"] = value is not None and theirs is not None and round(value, 4) == round(theirs, 4)
        result["ok"] = result["ok"] and result["equal_to_harness"]
    return result


LANGCHAIN = """
import asyncio, json, sys
from langchain_openai import ChatOpenAI
url, model, key = sys.argv[1:4]
options = {"max_tokens": 16, "temperature": 0, "max_retries": 0}
chat = ChatOpenAI(base_url=url + "/v1", model=model, api_key=key or "unused", **options)
said = chat.invoke("Say hello.").content
streamed = "".join(chunk.content for chunk in chat.stream("Say hello."))
batch = [m.content for m in chat.batch(["Say hello.", "Name a colour."])]
async def astream():
    return "".join([chunk.content async for chunk in chat.astream("Say hello.")])
print(json.dumps({"invoke": said, "stream": streamed, "batch": batch, "astream": asyncio.run(astream())}))
"""


def langchain(args: argparse.Namespace) -> dict:
    command = [f"{args.clients_bin}/python", "-c", LANGCHAIN, args.url, args.model, args.api_key or ""]
    code, output, seconds = run(command, 300)
    result = {"command": "python -c <LangChain invoke, stream, batch, astream>", "exit_code": code, "wall_s": seconds}
    try:
        said = json.loads(output.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return result | {"ok": False, "output_tail": output[-2000:]}
    same = said["invoke"] == said["stream"] == said["astream"] == said["batch"][0]  # greedy: one text
    return result | said | {"ok": code == 0 and same and all(said["batch"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="the served model id (default: %(default)s)")
    p.add_argument("--tokenizer", required=True, help="a local tokenizer folder of the served model")
    p.add_argument("--clients-bin", required=True, help="bin folder of the clients' virtual environment")
    p.add_argument("--api-key", default=os.environ.get("FASTFORWARD_API_KEY"), help="the server's key, if any")
    p.add_argument("--seconds", type=int, default=20, help="each guidellm run (default: %(default)s)")
    p.add_argument("--streams", type=int, default=4, help="guidellm's concurrent streams (default: %(default)s)")
    p.add_argument("--gen-n", type=int, default=10, help="ff_arithmetic problems (default: %(default)s)")
    p.add_argument("--harness", help="also run the harness on the multiple-choice task with these model_args")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    p.add_argument("--out", default=str(RESULTS / "api_clients.json"))
    args = p.parse_args()
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        p.error("--url: loopback only (http://127.0.0.1:PORT)")
    load_before = load_average()
    results = {}
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(temporary)
        for check in args.only:
            log(f"{check}...")
            if check.startswith("guidellm"):
                route = "/v1/chat/completions" if check == "guidellm-chat" else "/v1/completions"
                results[check] = guidellm(args, route, work)
            elif check.startswith("lm-eval"):
                results[check] = lm_eval(args, work, generation=check == "lm-eval-gen")
            else:
                results[check] = langchain(args)
            shown = {k: v for k, v in results[check].items() if k not in ("command", "output_tail")}
            log(f"{check}: {json.dumps(shown)}")
    record = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "url": args.url,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {args.out}; all ok: {all(r['ok'] for r in results.values())}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
