"""Widen the drafter-training prompts towards everyday chat (the shared training prompts lean to code and math).

Writes templated prompts — explain, list, compare, how-to, write (story, poem, e-mail), role-play, translate,
summarize, answer-from-passage, extract — over topic lists and over sentences/paragraphs taken from the *training*
prompts (never the benchmark set). Deterministic (seeded).

    python scripts/chat_prompts.py --out data/chat_prompts.jsonl --n 700
"""

from __future__ import annotations

import argparse
import json
import random
import re

TOPICS = """the water cycle; photosynthesis; black holes; the French Revolution; climate change; vaccines; the stock
market; inflation; machine learning; the human heart; volcanoes; the Roman Empire; renewable energy; sleep; coffee;
the internet; democracy; the moon landing; honey bees; earthquakes; the immune system; electric cars; recycling;
the Renaissance; jazz music; the Olympic Games; meditation; time management; public speaking; healthy eating;
learning a new language; saving money; job interviews; remote work; friendship; social media; chess; gardening;
baking bread; running a marathon; dinosaurs; the ocean; rainforests; deserts; the solar system; gravity; magnets;
electricity; the printing press; the Great Wall of China; ancient Egypt; the Cold War; the Industrial Revolution;
plate tectonics; DNA; antibiotics; the brain; dreams; happiness; stress; exercise; vitamins; tea; chocolate;
pizza; travel in Japan; visiting Paris; camping; photography; painting; reading habits; writing a novel; movies;
video games; smartphones; cybersecurity; passwords; cloud computing; robots; space travel; Mars; the Sun;
rainbows; snow; hurricanes; birds migrating; dogs; cats; elephants; whales; trees; soil; farming; cities;
traffic; bicycles; trains; airplanes; bridges; architecture; museums; libraries; teachers; exams; history of
mathematics; prime numbers; probability; statistics; budgeting; small businesses; marketing; customer service""".split(";")

TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}? Give a short answer.", "Why is {t} important?",
    "Give me five interesting facts about {t}.", "List the pros and cons of {t}.",
    "Write a short story about {t}.", "Write a poem about {t}.", "Write a haiku about {t}.",
    "Write a short blog post about {t}.", "Write an email to a friend telling them about {t}.",
    "Explain {t} to a ten-year-old.", "What are common misconceptions about {t}?",
    "How has {t} changed over the last hundred years?", "Give me three tips related to {t}.",
    "Pretend you are a tour guide and talk about {t}.", "You are a teacher. Introduce a lesson on {t}.",
    "Compare {t} and {u}.", "What do {t} and {u} have in common?", "Write a dialogue between two people about {t}.",
    "Summarize the history of {t} in a paragraph.", "Ask me three quiz questions about {t} and give the answers.",
    "What should a beginner know about {t}?", "Describe {t} in exactly three sentences.",
]
LANGS = ["French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Russian"]


def sentences(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        for s in re.split(r"(?<=[.!?])\s+", t):
            s = " ".join(s.split())
            if 40 <= len(s) <= 200 and not re.search(r"[{}<>`=_\\$|#]", s):
                out.append(s)
    return out


def paragraphs(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        for p in t.split("\n\n"):
            p = " ".join(p.split())
            if 250 <= len(p) <= 900 and not re.search(r"[{}<>`=_\\$|#]", p):
                out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=700)
    ap.add_argument("--train", nargs="+", default=["../shared/data/train/arena-hard-v2.jsonl",
                                                    "../shared/data/train/swe-bench.jsonl"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    texts = [json.loads(line)["turns"][0] for f in a.train for line in open(f) if line.strip()]
    sents, paras = sentences(texts), paragraphs(texts)
    topics = [t.strip() for t in TOPICS if t.strip()]
    out = []
    while len(out) < a.n:
        r = rng.random()
        if r < 0.55:
            t, u = rng.sample(topics, 2)
            out.append(rng.choice(TEMPLATES).format(t=t, u=u))
        elif r < 0.67 and sents:
            out.append(f"Translate to {rng.choice(LANGS)}: {rng.choice(sents)}")
        elif r < 0.80 and paras:
            out.append(rng.choice(["Summarize the following text in two sentences:\n\n{p}",
                                   "Give a one-sentence summary of this:\n{p}",
                                   "What is the main point of this passage?\n\n{p}"]).format(p=rng.choice(paras)))
        elif r < 0.90 and paras:
            p = rng.choice(paras)
            out.append(f"Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: What problem does the "
                       "passage describe, and what is asked?")
        elif sents:
            out.append(rng.choice(["Extract the key words from this sentence: {s}",
                                   "Rewrite this sentence more formally: {s}",
                                   "Is this sentence positive, negative or neutral? {s}"]).format(s=rng.choice(sents)))
    with open(a.out, "w") as f:
        for p in out:
            f.write(json.dumps({"turns": [p]}) + "\n")
    print(f"{len(out)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
