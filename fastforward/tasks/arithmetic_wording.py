"""The `arithmetic` task's varied wording (`phrasing="varied"`): stories told as people tell them.

The template themes (`fastforward.tasks.arithmetic_stories`) say each fact one way, so a model trained on them
learns the generator's sentences rather than the arithmetic: on problems phrased by hand in the same number
range it fails where a sentence shape is new ("4 boxes with 5 pencils in each box" read as 4 + 5). This module
adds what those lack:

* everyday stories (`everyday`, `crowd`): counts of things or people, each fact said in one of several shapes
  (groups as "k boxes of m", "m in each of k bags", "m a day for k days"; "twice as many", "half of them";
  people getting on and off, joining and leaving), the facts of a group in either order, and questions asked
  in several ways;
* `reword`: wording laid over any story's finished prompt: amounts in dollars or with `$`, small numbers in
  words, a linking word between facts, and at times one fact that the answer does not need (a distractor).

The worked solution keeps its form (a line per operation with `a <op> b = c`, then `#### answer`), so the
grading and the solution check are the template themes'.
"""

from __future__ import annotations

import re
from random import Random

from fastforward.tasks.arithmetic_stories import FRIENDS, NAMES, Move, Story, _play

ITEMS = [("apple", "apples"), ("marble", "marbles"), ("cookie", "cookies"), ("pencil", "pencils"),
         ("sticker", "stickers"), ("egg", "eggs"), ("balloon", "balloons"), ("crayon", "crayons"),
         ("cupcake", "cupcakes"), ("orange", "oranges"), ("button", "buttons"), ("comic", "comics"),
         ("toy", "toys"), ("candy", "candies"), ("rock", "rocks"), ("ribbon", "ribbons")]  # fmt: skip
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"), ("basket", "baskets"),
              ("tray", "trays"), ("bowl", "bowls"), ("tin", "tins")]  # fmt: skip
# (people, place, arrive, leave)
CROWDS = [("passengers", "bus", "get on", "get off"), ("students", "classroom", "come in", "leave"),
          ("children", "playground", "arrive", "go home"), ("people", "waiting room", "walk in", "are called in"),
          ("players", "field", "join the game", "leave the game"), ("birds", "tree", "land", "fly away")]  # fmt: skip
GROUPS = [("team", "teams"), ("group", "groups")]
MORE_NAMES = [("Sam", "he"), ("Ana", "she"), ("Jack", "he"), ("Emma", "she"), ("Luis", "he"), ("Priya", "she"),
              ("Owen", "he"), ("Chloe", "she"), ("Ali", "he"), ("Grace", "she")]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def _items(s: Story) -> tuple[str, str]:
    return s.rng.choice(ITEMS)


def everyday(s: Story, ops: int) -> int:
    """Someone's count of things, changed by gains, losses, groups, doubling and halving."""
    if s.rng.random() < 0.4:
        s.name, s.she = s.rng.choice(MORE_NAMES)
    one, many = _items(s)
    box, boxes = s.rng.choice(CONTAINERS)
    name = s.name
    if ops >= 2 and s.rng.random() < 0.4:  # the start is itself a group: one operation
        k, m = s.factor(), s.factor()
        start, line = s.calc(k, "*", m)
        s.sentences += s.rng.choice([
            [f"{name} has {k} {boxes} of {many}.", f"Each {box} holds {m} {many}."],
            [f"Each {box} holds {m} {many}, and {name} has {k} {boxes}."],
            [f"{name} bought {k} {boxes} with {m} {many} in each {box}."],
            [f"There are {m} {many} in a {box}. {name} has {k} full {boxes}."],
        ])  # fmt: skip
        s.steps.append(f"{name} has {line} {many}.")
        ops -= 1
    else:
        start = s.amount(2)
        s.sentences.append(s.rng.choice([
            f"{name} has {start} {many}.", f"{name} had {start} {many}.", f"At first {name} has {start} {many}.",
            f"There are {start} {many} in {name}'s {box}.", f"{name} starts with {start} {many}.",
        ]))  # fmt: skip
    s.question = s.rng.choice([
        f"How many {many} does {name} have now?", f"How many {many} does {name} have in the end?",
        f"How many {many} are there now?", f"How many {many} does {s.she} have now?",
        f"What is the number of {many} {name} has now?", f"How many {many} does {name} end up with?",
    ])  # fmt: skip

    def gain(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        friend = s.rng.choice(FRIENDS)
        s.sentences.append(s.rng.choice([
            f"{s.She} finds {a} more.", f"{s.She} buys {a} more {many}.",
            f"{friend.capitalize()} gives {s.him} {a} {many}.",
            f"{s.She} gets {a} {many} from {friend}.", f"Then {s.she} wins {a} more {many}.",
            f"{s.She} is given {a} more.", f"Later {s.she} picks up {a} more {many}.",
        ]))  # fmt: skip
        s.steps.append(f"{s.She} has {line} {many}.")
        return total

    def loss(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(s.rng.choice([
            f"{s.She} gives {a} to {s.rng.choice(FRIENDS)}.", f"{s.She} loses {a} of them.",
            f"{s.She} sells {a} {many}.", f"{a} of the {many} get lost.", f"{s.She} gives away {a} {many}.",
            f"Then {s.she} uses {a} of them.", f"{s.She} trades away {a} {many}.",
        ]))  # fmt: skip
        s.steps.append(f"{s.She} has {line} {many} left.")
        return left

    def groups(s: Story, v: int) -> int:
        k, m = s.factor(), s.factor()
        got, line = s.calc(k, "*", m)
        total, line2 = s.calc(v, "+", got)
        day = s.rng.choice(DAYS)
        s.sentences.append(s.rng.choice([
            f"{s.She} buys {k} {boxes} with {m} {many} in each {box}.", f"{s.She} gets {k} more {boxes} of {m}.",
            f"Then {s.she} gets {m} {many} a day for {k} days.", f"{k} friends each give {s.him} {m} {many}.",
            f"On {day} {s.she} adds {k} {boxes}, and each {box} has {m} {many} in it.",
        ]))  # fmt: skip
        s.steps += [f"That is {line} more {many}.", f"{s.She} has {line2} {many}."]
        return total

    def twice_as_many(s: Story, v: int) -> int:
        a = s.amount(1, max(1, s.max_number // 2))
        more, line = s.calc(a, "*", 2)
        both, line2 = s.calc(a, "+", more)
        total, line3 = s.calc(v, "+", both)
        day1, day2 = s.rng.sample(DAYS, 2)
        s.sentences.append(s.rng.choice([
            f"On {day1} {s.she} gets {a} more {many}, and on {day2} twice as many as on {day1}.",
            f"{s.She} finds {a} {many}, and then {s.she} finds twice as many.",
        ]))  # fmt: skip
        s.steps += [f"Twice as many is {line}.", f"Together {s.she} gets {line2} {many}."]
        s.steps.append(f"{s.She} has {line3} {many}.")
        return total

    def doubles(s: Story, v: int) -> int:
        total, line = s.calc(v, "*", 2)
        s.sentences.append(s.rng.choice([
            f"Then {s.her} number of {many} doubles.",
            f"{s.rng.choice(FRIENDS).capitalize()} gives {s.him} as many as {s.she} has.",
        ]))  # fmt: skip
        s.steps.append(f"Doubled, that is {line} {many}.")
        return total

    def half_away(s: Story, v: int) -> int | None:
        if v % 2:
            return None
        kept, line = s.calc(v, "/", 2)
        s.sentences.append(s.rng.choice([
            f"{s.She} gives half of {s.her} {many} to {s.rng.choice(FRIENDS)}.", f"{s.She} puts half of them away.",
            f"Half of the {many} are given away.",
        ]))  # fmt: skip
        s.steps.append(f"Half of them is {line}, so {s.she} keeps {kept} {many}.")
        return kept

    def share(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        each, line = s.calc(v, "/", k)
        s.sentences.append(s.rng.choice([
            f"{s.She} shares all of them equally among {k} friends.", f"{s.She} splits them equally into {k} {boxes}.",
        ]))  # fmt: skip
        s.question = s.rng.choice([f"How many {many} does each get?", f"How many {many} are in each share?"])
        s.steps.append(f"Each share has {line} {many}.")
        return each

    def pack(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        filled, line = s.calc(v, "/", k)
        s.sentences.append(f"{s.She} puts them into {boxes} of {k}.")
        s.question = s.rng.choice([f"How many {boxes} can {s.she} fill?", f"How many {boxes} does {name} need?"])
        s.steps.append(f"{s.She} fills {line} {boxes}.")
        return filled

    moves: list[Move] = [(1, False, gain), (1, False, loss), (2, False, groups), (3, False, twice_as_many),
                         (1, False, doubles), (1, False, half_away), (1, True, share), (1, True, pack)]  # fmt: skip
    return _play(s, start, ops, moves)


def crowd(s: Story, ops: int) -> int:
    """People in a place: some arrive, some leave, groups join, and at the end they split into equal groups."""
    people, place, arrive, leave = s.rng.choice(CROWDS)
    start = s.amount(2)
    s.sentences.append(s.rng.choice([
        f"There are {start} {people} in the {place}.", f"{start} {people} are in the {place}.",
        f"At first the {place} has {start} {people}.",
    ]))  # fmt: skip
    s.question = s.rng.choice([
        f"How many {people} are in the {place} now?", f"How many {people} are there now?",
        f"How many {people} are left in the {place}?",
    ])  # fmt: skip
    stops = iter(["At the first stop" if place == "bus" else "First", "Then", "After that", "Later", "Next"])

    def come(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{next(stops, 'Then')} {a} {people} {arrive}.")
        s.steps.append(f"Now there are {line} {people}.")
        return total

    def go(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(f"{next(stops, 'Then')} {a} {people} {leave}.")
        s.steps.append(f"Now there are {line} {people}.")
        return left

    def groups_come(s: Story, v: int) -> int:
        k, m = s.factor(), s.factor()
        got, line = s.calc(k, "*", m)
        total, line2 = s.calc(v, "+", got)
        group, groups = s.rng.choice(GROUPS)
        s.sentences.append(s.rng.choice([
            f"{next(stops, 'Then')} {k} {groups} of {m} {people} {arrive}.",
            f"{next(stops, 'Then')} {k} {groups} {arrive}, with {m} {people} in each {group}.",
        ]))  # fmt: skip
        s.steps += [f"The {groups} bring {line} {people}.", f"Now there are {line2} {people}."]
        return total

    def split(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        each, line = s.calc(v, "/", k)
        group, groups = s.rng.choice(GROUPS)
        s.sentences.append(f"Then the {people} split into {k} equal {groups}.")
        s.question = f"How many {people} are in each {group}?"
        s.steps.append(f"Each {group} has {line} {people}.")
        return each

    return _play(s, start, ops, [(1, False, come), (1, False, go), (2, False, groups_come), (1, True, split)])


WORDING_THEMES = {"everyday": everyday, "crowd": crowd}

_DOLLARS = re.compile(r"\$(\d+)")
_SMALL = re.compile(r"(?<=[a-z,] )([2-9]|10)(?= [a-z])(?! dollars)")  # mid-sentence, before a word
_STARTS_WITH_NAME = {name for name, _ in NAMES + MORE_NAMES}


def _distractor(rng: Random, s: Story, max_number: int) -> str:
    n = rng.randint(2, max_number)
    return rng.choice([
        f"{s.name} is {n} years old.", f"{s.her.capitalize()} little brother is {n}.",
        f"It takes {n} minutes to walk to the park.",
        f"The shop opens at {min(n, 12)} o'clock.", f"{s.her.capitalize()} friend lives {n} blocks away.",
        f"It is {n} degrees outside.", f"There are {n} windows in the house.",
    ])  # fmt: skip


def reword(rng: Random, s: Story) -> str:
    """The prompt of a finished story, worded one of many ways; the facts and their numbers unchanged."""
    sentences = list(s.sentences)
    if rng.random() < 0.3:
        sentences.insert(rng.randint(1, len(sentences)), _distractor(rng, s, s.max_number))
    if len(sentences) > 1 and rng.random() < 0.4:  # a linking word before a later fact
        i = rng.randint(1, len(sentences) - 1)
        first = sentences[i].split(" ", 1)[0]
        if first not in {"Then", "After", "Later", "Next", "At", "On", "It", "Each", "Half"} | _STARTS_WITH_NAME:
            linked = rng.choice(["After that, ", "Later, ", "Next, "])
            sentences[i] = linked + sentences[i][0].lower() + sentences[i][1:]
    text = " ".join([*sentences, s.question])
    if rng.random() < 0.4:
        text = _DOLLARS.sub(r"\1 dollars", text)
    if rng.random() < 0.25:
        text = _SMALL.sub(lambda m: WORDS[int(m.group(1))], text, count=rng.randint(1, 2))
    return text
