"""Write gsm8k_mini.jsonl: GSM8K-format word problems made from templates (deterministic, no download).

Each row has GSM8K's two fields: ``question`` and ``answer`` (worked reasoning, then ``#### <number>``). A few
questions are long on purpose, so the prompt-length statistics have a tail, as real datasets do.

    python examples/data/make_gsm8k_mini.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Rosa", "Omar"]
ITEMS = ["clips", "apples", "pencils", "stickers", "books", "marbles", "cookies", "stamps", "shells", "cards"]


def problem(rng: random.Random, i: int) -> dict[str, str]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = i % 5
    if kind == 0:
        a, b = rng.randint(10, 60), rng.randint(2, 5)
        total = a + a // b
        q = f"{name} sold {item} to {a} of her friends in April, and then she sold 1/{b} as many {item} in May. " \
            f"How many {item} did {name} sell altogether in April and May?"
        r = f"{name} sold {a} / {b} = <<{a}/{b}={a // b}>>{a // b} {item} in May.\n" \
            f"{name} sold {a} + {a // b} = <<{a}+{a // b}={total}>>{total} {item} altogether."
        return {"question": q, "answer": f"{r}\n#### {total}"}
    if kind == 1:
        rate, minutes = rng.randint(6, 30), rng.randint(10, 90)
        pay = rate * minutes // 60
        q = f"{name} earns ${rate} an hour for babysitting. Yesterday, she just did {minutes} minutes of babysitting. " \
            f"How much did she earn?"
        r = f"{name} earns {rate} / 60 dollars per minute.\nWorking {minutes} minutes, she earned " \
            f"{rate} * {minutes} / 60 = <<{rate}*{minutes}/60={pay}>>{pay}."
        return {"question": q, "answer": f"{r}\n#### {pay}"}
    if kind == 2:
        have, price, n = rng.randint(20, 100), rng.randint(2, 9), rng.randint(2, 8)
        left = have - price * n
        q = f"{name} has ${have}. She buys {n} {item} that cost ${price} each. How much money does she have left?"
        r = f"The {item} cost {n} * {price} = <<{n}*{price}={price * n}>>{price * n} dollars.\n" \
            f"She has {have} - {price * n} = <<{have}-{price * n}={left}>>{left} dollars left."
        return {"question": q, "answer": f"{r}\n#### {left}"}
    if kind == 3:
        a, b, c = rng.randint(3, 20), rng.randint(3, 20), rng.randint(2, 6)
        total = (a + b) * c
        q = f"{name} has {a} {item} and {other} has {b} {item}. They each buy enough to multiply their combined " \
            f"collection by {c}. How many {item} do they have together now?"
        r = f"Together they have {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n" \
            f"After multiplying, they have {a + b} * {c} = <<{a + b}*{c}={total}>>{total} {item}."
        return {"question": q, "answer": f"{r}\n#### {total}"}
    # long, multi-step problems: the tail of the prompt-length distribution
    days, per_day, extra, weeks = rng.randint(3, 7), rng.randint(4, 15), rng.randint(5, 40), rng.randint(2, 5)
    weekly = days * per_day + extra
    total = weekly * weeks
    q = (f"{name} is saving {item} for a school fair that takes place at the end of the month. Every week she "
         f"collects {per_day} {item} on each of {days} school days, because her neighbours and classmates give her "
         f"the ones they no longer need. On the weekend her grandmother, who lives two streets away and visits every "
         f"Saturday, adds another {extra} {item} to the box. {other} offered to help count them, but kept losing "
         f"track, so {name} wrote the numbers down in a notebook each evening. If she keeps collecting at the same "
         f"pace for {weeks} weeks, how many {item} will she bring to the fair?")
    r = (f"On school days she collects {days} * {per_day} = <<{days}*{per_day}={days * per_day}>>{days * per_day}.\n"
         f"Each week she collects {days * per_day} + {extra} = <<{days * per_day}+{extra}={weekly}>>{weekly}.\n"
         f"In {weeks} weeks she collects {weekly} * {weeks} = <<{weekly}*{weeks}={total}>>{total}.")
    return {"question": q, "answer": f"{r}\n#### {total}"}


def main() -> None:
    rng = random.Random(1234)
    rows = [problem(rng, i) for i in range(200)]
    out = Path(__file__).with_name("gsm8k_mini.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
