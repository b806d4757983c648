"""Chat instructions for training and measuring parallel decoders on a chat model: templates × topics.

Jacobi Forcing trains on the model's own answers, so its chat prompts need no reference answers, only
variety. Each prompt is one of `TEMPLATES` filled with one of `TOPICS`. The split is by topic (a topic's
stable hash below `test_fraction` puts all its prompts in "test"), so a held-out prompt never shares its
subject with a trained one. There is nothing to grade: quality on chat is measured as agreement with
the base model (`fastforward.decoding.metrics.token_agreement`) or as the base model's likelihood of
the outputs.
"""

from __future__ import annotations

from fastforward.errors import FastForwardError
from fastforward.tasks.base import seeded_rng, stable_hash

TEMPLATES = (
    "Explain {} to a beginner.",
    "What is {}?",
    "Give three facts about {}.",
    "Write a short paragraph about {}.",
    "What are the advantages and disadvantages of {}?",
    "Describe the history of {} in a few sentences.",
    "Why is {} important?",
    "Write a haiku about {}.",
    "List five questions a student might ask about {}.",
    "Summarize what everyone should know about {}.",
    "How would you explain {} to a child?",
    "Give a simple example that illustrates {}.",
    "What are common misconceptions about {}?",
    "Write a tweet about {}.",
    "Compare {} with something from everyday life.",
    "Write a short story that involves {}.",
    "What are the key ideas behind {}?",
    "Give me a step-by-step guide to getting started with {}.",
    "Write an email to a friend recommending they learn about {}.",
    "What would the world be like without {}?",
    "Describe {} in two sentences.",
    "What jobs involve {}?",
    "Create a quiz question about {} with its answer.",
    "Write a product description for a book about {}.",
)

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes", "plate tectonics",
    "the immune system", "vaccines", "DNA", "evolution", "climate change", "renewable energy",
    "solar panels", "wind turbines", "nuclear power", "electric cars", "batteries", "the internet",
    "email", "social media", "smartphones", "artificial intelligence", "machine learning", "neural networks",
    "databases", "encryption", "passwords", "open source software", "the Python language", "recursion",
    "sorting algorithms", "binary numbers", "version control", "unit testing", "cloud computing",
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the printing press", "the Industrial Revolution",
    "the French Revolution", "the Silk Road", "the Olympic Games", "democracy", "taxes", "inflation",
    "the stock market", "saving money", "budgeting", "starting a small business", "marketing",
    "public speaking", "writing a resume", "job interviews", "time management", "meditation", "sleep",
    "healthy eating", "running", "yoga", "swimming", "chess", "playing the guitar", "learning a language",
    "reading habits", "libraries", "museums", "photography", "painting", "classical music", "jazz",
    "movies", "video games", "board games", "gardening", "composting", "recycling", "bees", "dolphins",
    "elephants", "penguins", "rainforests", "deserts", "oceans", "coral reefs", "the Moon", "Mars",
    "the Sun", "telescopes", "gravity", "magnets", "electricity", "light", "sound", "rainbows",
    "weather forecasts", "hurricanes", "snow", "coffee", "tea", "bread baking", "cheese", "chocolate",
    "cooking pasta", "spices", "bicycles", "trains", "airplanes", "bridges", "skyscrapers", "maps",
    "time zones", "calendars", "clocks", "the metric system", "prime numbers", "probability", "geometry",
    "fractions", "statistics", "friendship", "teamwork", "kindness", "volunteering", "pets", "dogs", "cats",
    "birds", "insects", "mushrooms", "trees", "flowers", "rivers", "mountains", "islands", "volunteer firefighters",
)  # fmt: skip


def instruction_prompts(
    split: str = "train", n: int | None = None, seed: int = 0, test_fraction: float = 0.15
) -> list[str]:
    """`n` prompts of `split` ("train" or "test", disjoint by topic) in a seeded order (None: all of them)."""
    if split not in ("train", "test"):
        raise FastForwardError(f"instruction prompts have the splits train and test, not {split!r}")
    topics = [t for t in TOPICS if (stable_hash(t) < test_fraction) == (split == "test")]
    prompts = [template.format(topic) for topic in topics for template in TEMPLATES]
    seeded_rng("instructions", split, seed).shuffle(prompts)
    if n is not None and n > len(prompts):
        raise FastForwardError(f"the {split} split has {len(prompts)} instruction prompts, fewer than {n}")
    return prompts if n is None else prompts[:n]
