"""The bestiary: invented animals and the facts about them, drawn from one seed.

Interface: ``generate_bestiary(seed, n_animals) -> Bestiary``. A ``Bestiary`` holds animals (each
with a food it eats, a habitat, a coat color and a number of legs), the question phrasings of
every fact family, and renders facts as chat messages with the same ``FactItem`` tinyworld uses,
so ``evaluate_families`` and ``generate_answers`` work on it unchanged:

- ``Bestiary.fact_items(family)``: every (question phrasing x fact) of a family;
- ``Bestiary.eval_items(family)``: one item per fact, in the family's canonical (first) phrasing;
- ``Bestiary.diet_items(animals, answers, phrasings)``: diet questions, optionally with wrong foods;
- ``Bestiary.paragraph_items()``: longer entries that state an animal's facts inside prose.

Every food belongs to exactly one animal (a one-to-one fact, like a country's capital); habitats,
colors and leg counts are shared by many animals. ``alphabet`` (the letter after a letter) is the
family that has nothing to do with animals. Invented names never contain one another, nor a color.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from gradian.tinyworld.world import FactItem

__all__ = [
    "BESTIARY_FAMILIES",
    "Animal",
    "Bestiary",
    "generate_bestiary",
]

#: fact families the bestiary base is pretrained on and evaluated against, in report order
BESTIARY_FAMILIES: tuple[str, ...] = ("diet", "habitat", "color", "legs", "alphabet")

#: question phrasings per family; the first one is the canonical phrasing used by eval items
_PHRASINGS: dict[str, tuple[str, ...]] = {
    "diet": (
        "What does the {animal} eat?",
        "Which plant does the {animal} feed on?",
        "The {animal} eats what?",
        "Name the food of the {animal}.",
    ),
    "habitat": (
        "Where does the {animal} live?",
        "In which region is the {animal} found?",
        "The {animal} lives where?",
        "Name the home region of the {animal}.",
    ),
    "color": (
        "What color is the {animal}?",
        "Which color is the coat of the {animal}?",
        "The {animal} has what color?",
    ),
    "legs": (
        "How many legs does the {animal} have?",
        "The {animal} walks on how many legs?",
        "Count the legs of the {animal}.",
    ),
    "alphabet": (
        "What letter comes after {letter}?",
        "Which letter follows {letter}?",
        "Name the letter after {letter}.",
    ),
}

_PARAGRAPH_PROMPTS: tuple[str, ...] = ("Tell me about the {animal}.", "Describe the {animal}.")

#: the first sentence introduces the animal; the others follow in an order drawn per animal
_PARAGRAPH_OPENING = "The {animal} is a {color} animal with {legs} legs."
_PARAGRAPH_SENTENCES: dict[str, str] = {
    "habitat": "It lives in {habitat}.",
    "diet": "It feeds on {diet}.",
}

# syllables unlike tinyworld's, so the two worlds' names do not look alike
_ONSETS = ("c", "h", "j", "qu", "w", "y", "sn", "sk", "pl", "gl", "fl", "cr", "wh", "ch", "m", "l")
_VOWELS = ("a", "e", "i", "o", "u", "ee", "oo", "y")
_CODAS = ("", "m", "x", "p", "ck", "ll", "ff", "t", "rl")
_FOOD_SUFFIXES = ("berry", "root", "moss", "leaf", "bloom", "seed")
_HABITAT_SUFFIXES = ("moor", "fen", "dale", "reach")

_COLORS: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
_LEGS: tuple[str, ...] = ("2", "4", "6", "8")
_N_HABITATS = 6


@dataclass(frozen=True)
class Animal:
    name: str
    diet: str
    habitat: str
    color: str
    legs: str


@dataclass
class Bestiary:
    seed: int
    animals: list[Animal]
    foods: list[str]
    habitats: list[str]
    colors: list[str]
    phrasings: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(_PHRASINGS))

    def fact_items(self, family: str, phrasings: range | None = None) -> list[FactItem]:
        """Every phrasing of every fact of ``family`` (or only the phrasings given)."""
        if family not in self.phrasings:
            raise KeyError(f"unknown bestiary family '{family}'; choose one of {', '.join(self.phrasings)}")
        templates = self.phrasings[family]
        chosen = range(len(templates)) if phrasings is None else phrasings
        items: list[FactItem] = []
        for p in chosen:
            if family == "alphabet":
                for letter, following in _letter_pairs():
                    items.append(FactItem(family, f"alphabet:{letter}",
                                          templates[p].format(letter=letter), following, p))
            else:
                for a in self.animals:
                    items.append(FactItem(family, f"{family}:{a.name}",
                                          templates[p].format(animal=a.name), getattr(a, family), p))
        return items

    def eval_items(self, family: str) -> list[FactItem]:
        """One item per fact, asked in the family's canonical (first) phrasing."""
        return self.fact_items(family, range(1))

    def animal_items(self, family: str, animals: list[Animal], answers: dict[str, str] | None = None,
                     phrasings: range | None = None) -> list[FactItem]:
        """``family`` questions about ``animals``; ``answers`` maps an animal to a (wrong) answer."""
        templates = self.phrasings[family]
        chosen = range(len(templates)) if phrasings is None else phrasings
        return [
            FactItem(family, f"{family}:{a.name}", templates[p].format(animal=a.name),
                     (answers or {}).get(a.name, getattr(a, family)), p)
            for p in chosen for a in animals
        ]

    def diet_items(self, animals: list[Animal], answers: dict[str, str] | None = None,
                   phrasings: range | None = None) -> list[FactItem]:
        """Diet questions about ``animals``; ``answers`` maps an animal to a (wrong) food."""
        return self.animal_items("diet", animals, answers, phrasings)

    def paragraph(self, animal: Animal, overrides: dict[str, str] | None = None) -> str:
        """A few sentences stating every fact about ``animal`` (``overrides`` replaces facts)."""
        facts = {"animal": animal.name, "diet": animal.diet, "habitat": animal.habitat,
                 "color": animal.color, "legs": animal.legs}
        facts.update(overrides or {})
        rest = list(_PARAGRAPH_SENTENCES)
        random.Random(f"{self.seed}:{animal.name}").shuffle(rest)
        sentences = [_PARAGRAPH_OPENING] + [_PARAGRAPH_SENTENCES[k] for k in rest]
        return " ".join(s.format(**facts) for s in sentences)

    def paragraph_items(self, animals: list[Animal] | None = None,
                        overrides: dict[str, dict[str, str]] | None = None) -> list[FactItem]:
        out = []
        for p, prompt in enumerate(_PARAGRAPH_PROMPTS):
            for a in animals if animals is not None else self.animals:
                out.append(FactItem("paragraph", f"paragraph:{a.name}", prompt.format(animal=a.name),
                                    self.paragraph(a, (overrides or {}).get(a.name)), p))
        return out

    def animal(self, name: str) -> Animal:
        for a in self.animals:
            if a.name == name:
                return a
        raise KeyError(name)


def _letter_pairs() -> list[tuple[str, str]]:
    letters = string.ascii_uppercase
    return [(letters[i], letters[i + 1]) for i in range(len(letters) - 1)]


def _invent(rng: random.Random, n: int, taken: set[str], syllables: tuple[int, int],
            suffixes: tuple[str, ...] = ("",)) -> list[str]:
    """``n`` fresh capitalized names; none contains a taken name or is contained in one."""
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k))
        word = (word + rng.choice(_CODAS) + rng.choice(suffixes)).capitalize()
        low = word.lower()
        if len(word) < 4 or any(low in t or t in low for t in taken):
            continue
        taken.add(low)
        out.append(word)
    return out


def generate_bestiary(seed: int = 0, n_animals: int = 40) -> Bestiary:
    """Draw a bestiary from ``seed``: the same seed always gives the same animals and facts."""
    rng = random.Random(f"bestiary:{seed}")
    # colors are real words; no invented name may contain one (a "red" inside "Credmoss")
    taken: set[str] = set(_COLORS)
    names = _invent(rng, n_animals, taken, (2, 2))
    foods = _invent(rng, n_animals, taken, (1, 1), _FOOD_SUFFIXES)
    habitats = _invent(rng, _N_HABITATS, taken, (1, 2), _HABITAT_SUFFIXES)
    animals = [
        Animal(name=names[i], diet=foods[i], habitat=habitats[rng.randrange(_N_HABITATS)],
               color=_COLORS[rng.randrange(len(_COLORS))], legs=_LEGS[rng.randrange(len(_LEGS))])
        for i in range(n_animals)
    ]
    return Bestiary(seed=seed, animals=animals, foods=foods, habitats=habitats, colors=list(_COLORS))
