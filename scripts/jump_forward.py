"""Tokens per target pass with and without grammar jump-forward, on the structured requests of the tests (a
forced tool call, a response_format JSON schema, a JSON object), plain and with a drafter, greedy, SmolLM2-135M.

    python scripts/jump_forward.py [--dtype bf16] [--spec '{"method": "ngram"}']
"""

import argparse
import json

from specloom import load
from specloom.serving.grammar import compile_constraint
from specloom.serving.tools import plan_request
from specloom.step import Stepper

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]},
                                                "days": {"type": "integer"}},
                                                "required": ["city", "unit", "days"]}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "role": {"enum": ["student", "teacher", "engineer"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
    "required": ["name", "age", "role", "skills"], "additionalProperties": False}
REQUESTS = {
    "forced tool call": {"messages": [{"role": "user", "content": "What's the weather in Paris in celsius for the "
                                                                  "next 3 days?"}],
                         "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "response_format json_schema": {
        "messages": [{"role": "user", "content": "Describe Ada, a 36 year old engineer who likes math and poetry, as "
                                                 "JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    "response_format json_object": {
        "messages": [{"role": "user", "content": "Give the capital of France as a JSON object with the key "
                                                 "\"capital\"."}], "response_format": {"type": "json_object"}},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--spec", default=None, help="a drafter (JSON); default: plain decoding and ngram")
    args = ap.parse_args()
    specs = [json.loads(args.spec)] if args.spec else [None, {"method": "ngram"}]
    print("| request | drafter | tokens | passes without | passes with | tokens/pass without | with | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for spec in specs:
        e = load("smollm2-135m", spec, dtype=args.dtype, progress=False, speculation="fixed")
        for name, body in REQUESTS.items():
            plan = plan_request(body, e.tokenizer)
            ids = e.tokenizer.encode_chat(plan.messages, **plan.template_kwargs)
            out = {}
            for jump in (False, True):
                Stepper.jump_forward = jump
                c = compile_constraint(plan.grammar, e.tokenizer, e.model.config.vocab_size)
                out[jump] = e.generate(prompt_token_ids=ids, max_tokens=96, constraint=c)
            Stepper.jump_forward = True
            n = len(out[True].token_ids)
            a, b = out[False].num_target_passes, out[True].num_target_passes
            print(f"| {name} | {spec['method'] if spec else 'none'} | {n} | {a} | {b} | "
                  f"{len(out[False].token_ids) / a:.2f} | {n / b:.2f} | "
                  f"{out[True].token_ids == out[False].token_ids} |", flush=True)


if __name__ == "__main__":
    main()
