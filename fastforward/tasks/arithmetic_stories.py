"""The `arithmetic` task's stories: the themes a problem is told in (shopping, travel, collecting, savings,
recipes, wages, gardening, reading), the names, items and units they are filled with, and the worked
solution each builds, one line per operation (`fastforward.tasks.arithmetic` draws from them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

NAMES = [
    ("Mia", "she"), ("Liam", "he"), ("Ava", "she"), ("Noah", "he"), ("Zoe", "she"), ("Omar", "he"),
    ("Lena", "she"), ("Ravi", "he"), ("Sara", "she"), ("Tom", "he"), ("Yuki", "she"), ("Diego", "he"),
    ("Nora", "she"), ("Ben", "he"), ("Ines", "she"), ("Kofi", "he"), ("Hana", "she"), ("Leo", "he"),
]  # fmt: skip
FRIENDS = ["a cousin", "a neighbor", "a classmate", "the teacher", "an old friend", "the coach"]
GOODS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("book", "books"),
         ("ticket", "tickets"), ("candle", "candles"), ("sandwich", "sandwiches"), ("toy car", "toy cars")]  # fmt: skip
THINGS = ["a gift", "lunch", "a movie ticket", "a plant", "a new cap", "bus fare", "a board game"]
CHORES = ["washing cars", "walking dogs", "mowing lawns", "selling lemonade", "babysitting"]
COLLECTIBLES = ["stickers", "marbles", "stamps", "shells", "cards", "beads", "coins"]
VEHICLES = [("train", "km"), ("car", "miles"), ("bus", "km"), ("truck", "miles"), ("van", "km")]
FOODS = ["cookies", "muffins", "pancakes", "bread", "waffles"]
INGREDIENTS = ["milk", "water", "oats", "butter", "yogurt"]
PLANTS = [("tomato plant", "tomato plants", "tomatoes"), ("pepper plant", "pepper plants", "peppers"),
          ("apple tree", "apple trees", "apples"), ("bean plant", "bean plants", "beans")]  # fmt: skip
WEEKDAYS = ["Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


@dataclass
class Story:
    """A problem under construction: the story, the worked steps and the running value."""

    rng: Random
    max_number: int
    max_factor: int
    name: str = ""
    she: str = "she"
    sentences: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    question: str = ""

    def __post_init__(self) -> None:
        self.name, self.she = self.rng.choice(NAMES)

    @property
    def her(self) -> str:
        return "her" if self.she == "she" else "his"

    @property
    def him(self) -> str:
        return "her" if self.she == "she" else "him"

    @property
    def She(self) -> str:  # noqa: N802 - reads like the text it produces
        return self.she.capitalize()

    def amount(self, low: int = 1, high: int | None = None) -> int:
        high = self.max_number if high is None else min(high, self.max_number)
        return self.rng.randint(low, max(low, high))

    def factor(self) -> int:
        return self.rng.randint(2, self.max_factor)

    def divisor(self, value: int) -> int | None:
        """A divisor of `value` in [2, max_factor], or None."""
        options = [d for d in range(2, self.max_factor + 1) if value % d == 0 and value // d >= 1]
        return self.rng.choice(options) if options else None

    def calc(self, a: int, op: str, b: int) -> tuple[int, str]:
        result = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        return result, f"{a} {op} {b} = {result}"


# A move is (operations it takes, is it the last move, function). The function adds to the story and
# returns the new value, or None when it does not apply to the current value (then nothing is added).
Move = tuple[int, bool, Callable[[Story, int], int | None]]


def _play(s: Story, value: int, ops: int, moves: list[Move]) -> int:
    """Apply random applicable moves until exactly `ops` operations are used."""
    while ops > 0:
        options = [(cost, fn) for cost, last, fn in moves if cost <= ops and (not last or cost == ops)]
        s.rng.shuffle(options)
        for cost, fn in options:
            new = fn(s, value)
            if new is not None:
                value, ops = new, ops - cost
                break
        else:  # every theme has an always-applicable one-operation move, so this means a bug
            raise RuntimeError(f"no applicable move with {ops} operations left")
    return value


# ---- themes: each returns the final answer, having filled the story's sentences, steps and question ----
def _shopping(s: Story, ops: int) -> int:
    money = s.amount(max(2, s.max_number // 2))
    s.sentences.append(f"{s.name} has ${money}.")
    s.question = f"How many dollars does {s.name} have now?"

    def buy(s: Story, v: int) -> int | None:
        one, many = s.rng.choice(GOODS)
        k, price = s.factor(), s.rng.randint(1, s.max_factor)
        cost, line = s.calc(k, "*", price)
        if cost >= v:
            return None
        left, line2 = s.calc(v, "-", cost)
        s.sentences.append(f"{s.She} buys {k} {many} that cost ${price} each.")
        s.steps += [f"The {many} cost {line} dollars.", f"{s.name} has {line2} dollars left."]
        return left

    def spend(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(f"{s.She} spends ${a} on {s.rng.choice(THINGS)}.")
        s.steps.append(f"{s.name} has {line} dollars left.")
        return left

    def earn(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{s.She} earns ${a} {s.rng.choice(CHORES)}.")
        s.steps.append(f"{s.name} now has {line} dollars.")
        return total

    def split(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        each, line = s.calc(v, "/", k)
        s.sentences.append(f"{s.She} puts all of {s.her} money equally into {k} envelopes.")
        s.question = "How many dollars are in each envelope?"
        s.steps.append(f"Each envelope gets {line} dollars.")
        return each

    return _play(s, money, ops, [(2, False, buy), (1, False, spend), (1, False, earn), (1, True, split)])


def _travel(s: Story, ops: int) -> int:
    vehicle, unit = s.rng.choice(VEHICLES)
    speed, hours = s.amount(5), s.factor()
    dist, line = s.calc(speed, "*", hours)
    s.sentences.append(f"A {vehicle} travels at {speed} {unit} per hour for {hours} hours.")
    s.steps.append(f"First the {vehicle} travels {line} {unit}.")
    s.question = f"How many {unit} does the {vehicle} travel in total?"
    back_done = False

    def leg(s: Story, v: int) -> int:
        speed2, hours2 = s.amount(5), s.factor()
        d, line = s.calc(speed2, "*", hours2)
        total, line2 = s.calc(v, "+", d)
        s.sentences.append(f"Then it travels at {speed2} {unit} per hour for {hours2} more hours.")
        s.steps += [f"Next it travels {line} {unit}.", f"So far it travels {line2} {unit}."]
        return total

    def extra(s: Story, v: int) -> int:
        d = s.amount()
        total, line = s.calc(v, "+", d)
        s.sentences.append(f"After a short stop it goes another {d} {unit}.")
        s.steps.append(f"Now it has traveled {line} {unit}.")
        return total

    def back(s: Story, v: int) -> int | None:
        nonlocal back_done
        if back_done:
            return None
        back_done = True
        total, line = s.calc(v, "*", 2)
        s.sentences.append("Then it makes the same trip back.")
        s.steps.append(f"There and back is {line} {unit}.")
        return total

    def fuel(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        liters, line = s.calc(v, "/", k)
        s.sentences.append(f"It uses 1 liter of fuel for every {k} {unit}.")
        s.question = f"How many liters of fuel does the {vehicle} use?"
        s.steps.append(f"It uses {line} liters of fuel.")
        return liters

    return _play(s, dist, ops - 1, [(2, False, leg), (1, False, extra), (1, False, back), (1, True, fuel)])


def _collecting(s: Story, ops: int) -> int:
    items = s.rng.choice(COLLECTIBLES)
    start = s.amount(2)
    s.sentences.append(f"{s.name} has {start} {items}.")
    s.question = f"How many {items} does {s.name} have now?"
    doubled = False

    def boxes(s: Story, v: int) -> int:
        k, m = s.factor(), s.factor()
        got, line = s.calc(k, "*", m)
        total, line2 = s.calc(v, "+", got)
        s.sentences.append(f"{s.She} gets {k} packs with {m} {items} in each.")
        s.steps += [f"The packs hold {line} {items}.", f"{s.name} has {line2} {items}."]
        return total

    def give(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(f"{s.She} gives {a} {items} to {s.rng.choice(FRIENDS)}.")
        s.steps.append(f"{s.name} has {line} {items} left.")
        return left

    def find(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{s.She} finds {a} more {items}.")
        s.steps.append(f"{s.name} has {line} {items}.")
        return total

    def double(s: Story, v: int) -> int | None:
        nonlocal doubled
        if doubled:
            return None
        doubled = True
        total, line = s.calc(v, "*", 2)
        s.sentences.append(f"Then {s.rng.choice(FRIENDS)} gives {s.him} as many {items} as {s.she} has.")
        s.steps.append(f"That doubles the {items}: {line}.")
        return total

    def share(s: Story, v: int) -> int | None:
        k = s.divisor(v)
        if k is None:
            return None
        each, line = s.calc(v, "/", k)
        s.sentences.append(f"{s.She} shares all of them equally among {k} friends.")
        s.question = f"How many {items} does each friend get?"
        s.steps.append(f"Each friend gets {line} {items}.")
        return each

    moves: list[Move] = [(2, False, boxes), (1, False, give), (1, False, find), (1, False, double), (1, True, share)]
    return _play(s, start, ops, moves)


def _savings(s: Story, ops: int) -> int:
    per_week, weeks = s.amount(2), s.factor()
    saved, line = s.calc(per_week, "*", weeks)
    s.sentences.append(f"{s.name} saves ${per_week} every week for {weeks} weeks.")
    s.steps.append(f"{s.name} saves {line} dollars.")
    s.question = f"How many dollars has {s.name} saved now?"
    givers = s.rng.sample(["For {her} birthday", "From {her} grandmother", "As a prize"], k=3)

    def gift(s: Story, v: int) -> int | None:
        if not givers:
            return None
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(givers.pop().format(her=s.her) + f" {s.she} gets ${a} and saves it too.")
        s.steps.append(f"With the gift {s.she} has {line} dollars.")
        return total

    def spend(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(f"{s.She} takes out ${a} for {s.rng.choice(THINGS)}.")
        s.steps.append(f"{s.She} has {line} dollars saved.")
        return left

    def more_weeks(s: Story, v: int) -> int:
        a, w = s.amount(2), s.factor()
        more, line = s.calc(a, "*", w)
        total, line2 = s.calc(v, "+", more)
        s.sentences.append(f"Then {s.she} saves ${a} a week for {w} more weeks.")
        s.steps += [f"That adds {line} dollars.", f"{s.She} has {line2} dollars saved."]
        return total

    def charity(s: Story, v: int) -> int | None:
        if v % 2:
            return None
        half, line = s.calc(v, "/", 2)
        s.sentences.append(f"{s.She} gives half of {s.her} savings to charity.")
        s.question = f"How many dollars does {s.name} give to charity?"
        s.steps.append(f"{s.She} gives {line} dollars.")
        return half

    moves: list[Move] = [(1, False, gift), (1, False, spend), (2, False, more_weeks), (1, True, charity)]
    return _play(s, saved, ops - 1, moves)


def _recipe(s: Story, ops: int) -> int:
    food = s.rng.choice(FOODS)
    flour, sugar = s.factor(), s.factor()
    cups, line = s.calc(flour, "+", sugar)
    s.sentences.append(f"One batch of {food} needs {flour} cups of flour and {sugar} cups of sugar.")
    s.steps.append(f"One batch needs {line} cups.")
    extras = s.rng.sample(INGREDIENTS, k=len(INGREDIENTS))
    # Ingredients per batch first (ops - 2 of them at most), then the batches, then what follows.
    before = s.rng.randint(0, ops - 2)
    for _ in range(before):
        a, ingredient = s.factor(), extras.pop()
        cups, line = s.calc(cups, "+", a)
        s.sentences.append(f"It also needs {a} cups of {ingredient}.")
        s.steps.append(f"With the {ingredient} one batch needs {line} cups.")
    batches = s.factor()
    total, line = s.calc(cups, "*", batches)
    s.sentences.append(f"{s.name} makes {batches} batches.")
    s.steps.append(f"{batches} batches need {line} cups.")
    s.question = "How many cups of ingredients are needed in total?"
    doubled = False

    def double(s: Story, v: int) -> int | None:
        nonlocal doubled
        if doubled:
            return None
        doubled = True
        total, line = s.calc(v, "*", 2)
        s.sentences.append(f"The next day {s.she} makes the same amount again.")
        s.steps.append(f"Both days need {line} cups.")
        return total

    def extra(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{s.She} spills {a} cups and has to replace them.")
        s.steps.append(f"With the spill that is {line} cups.")
        return total

    def pantry(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        have = s.amount(1, v - 1)
        need, line = s.calc(v, "-", have)
        s.sentences.append(f"{s.She} already has {have} cups of ingredients at home.")
        s.question = f"How many more cups does {s.name} need to buy?"
        s.steps.append(f"{s.She} needs to buy {line} cups.")
        return need

    return _play(s, total, ops - 2 - before, [(1, False, double), (1, False, extra), (1, True, pantry)])


def _wages(s: Story, ops: int) -> int:
    rate, hours = s.amount(5, max(5, s.max_number // 2)), s.factor()
    earned, line = s.calc(rate, "*", hours)
    s.sentences.append(f"{s.name} earns ${rate} an hour and works {hours} hours on Monday.")
    s.steps.append(f"On Monday {s.she} earns {line} dollars.")
    s.question = f"How many dollars does {s.name} have at the end of the week?"
    days = list(WEEKDAYS)

    def day(s: Story, v: int) -> int | None:
        if not days:
            return None
        name = days.pop(0)
        h = s.factor()
        pay, line = s.calc(rate, "*", h)
        total, line2 = s.calc(v, "+", pay)
        s.sentences.append(f"On {name} {s.she} works {h} hours.")
        s.steps += [f"On {name} {s.she} earns {line} dollars.", f"Together that is {line2} dollars."]
        return total

    def bonus(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{s.She} also gets a ${a} bonus.")
        s.steps.append(f"With the bonus {s.she} has {line} dollars.")
        return total

    def lunch(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        a = s.amount(1, v - 1)
        left, line = s.calc(v, "-", a)
        s.sentences.append(f"{s.She} spends ${a} on {s.rng.choice(THINGS)}.")
        s.steps.append(f"{s.She} has {line} dollars left.")
        return left

    def save_half(s: Story, v: int) -> int | None:
        if v % 2:
            return None
        half, line = s.calc(v, "/", 2)
        s.sentences.append(f"At the end of the week {s.she} puts half of {s.her} money into savings.")
        s.question = f"How many dollars does {s.name} put into savings?"
        s.steps.append(f"{s.She} saves {line} dollars.")
        return half

    return _play(s, earned, ops - 1, [(2, False, day), (1, False, bonus), (1, False, lunch), (1, True, save_half)])


def _garden(s: Story, ops: int) -> int:
    one, many, fruit = s.rng.choice(PLANTS)
    rows, per_row = s.factor(), s.factor()
    plants, line = s.calc(rows, "*", per_row)
    s.sentences.append(f"{s.name} plants {rows} rows of {many} with {per_row} in each row.")
    s.steps.append(f"{s.She} plants {line} {many}.")
    s.question = f"How many {many} does {s.name} have now?"

    def more_rows(s: Story, v: int) -> int:
        r = s.factor()
        more, line = s.calc(r, "*", per_row)
        total, line2 = s.calc(v, "+", more)
        s.sentences.append(f"Later {s.she} plants {r} more rows with {per_row} in each row.")
        s.steps += [f"The new rows have {line} {many}.", f"{s.She} has {line2} {many}."]
        return total

    def die(s: Story, v: int) -> int | None:
        if v < 2:
            return None
        d = s.amount(1, v - 1)
        left, line = s.calc(v, "-", d)
        s.sentences.append(f"{d} of the {many} die in a storm.")
        s.steps.append(f"{s.She} has {line} {many} left.")
        return left

    def buy(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"{s.She} buys {a} more {many}.")
        s.steps.append(f"{s.She} has {line} {many}.")
        return total

    def harvest(s: Story, v: int) -> int:
        k = s.factor()
        total, line = s.calc(v, "*", k)
        s.sentences.append(f"Each {one} gives {k} {fruit}.")
        s.question = f"How many {fruit} does {s.name} pick?"
        s.steps.append(f"{s.She} picks {line} {fruit}.")
        return total

    return _play(s, plants, ops - 1, [(2, False, more_rows), (1, False, die), (1, False, buy), (1, True, harvest)])


def _reading(s: Story, ops: int) -> int:
    per_day, days = s.amount(2, max(2, s.max_number // 2)), s.factor()
    read, line = s.calc(per_day, "*", days)
    intro = f"{s.name} reads {per_day} pages a day for {days} days."
    s.steps.append(f"{s.She} reads {line} pages.")

    def weekend(s: Story, v: int) -> int:
        p, d = s.amount(2, max(2, s.max_number // 2)), s.factor()
        more, line = s.calc(p, "*", d)
        total, line2 = s.calc(v, "+", more)
        s.sentences.append(f"Then {s.she} reads {p} pages a day for {d} more days.")
        s.steps += [f"Then {s.she} reads {line} pages.", f"So far {s.she} has read {line2} pages."]
        return total

    def extra(s: Story, v: int) -> int:
        a = s.amount()
        total, line = s.calc(v, "+", a)
        s.sentences.append(f"On the train {s.she} reads {a} more pages.")
        s.steps.append(f"So far {s.she} has read {line} pages.")
        return total

    def left(s: Story, v: int) -> int:
        book = v + s.amount()
        rest, line = s.calc(book, "-", v)
        s.sentences.insert(0, f"A book has {book} pages.")
        s.question = "How many pages are left to read?"
        s.steps.append(f"{s.She} has {line} pages left.")
        return rest

    s.sentences.append(intro)
    return left(s, _play(s, read, ops - 2, [(2, False, weekend), (1, False, extra)]))


THEMES: dict[str, Callable[[Story, int], int]] = {
    "shopping": _shopping,
    "travel": _travel,
    "collecting": _collecting,
    "savings": _savings,
    "recipe": _recipe,
    "wages": _wages,
    "garden": _garden,
    "reading": _reading,
}
# Themes whose first sentence is already an operation need at least that many operations.
MIN_OPS = {"recipe": 2, "reading": 2}
