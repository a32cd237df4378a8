"""The delta world: invented rivers and the facts about them, drawn from one seed.

Interface: ``generate_delta(seed, n_rivers) -> Delta``. A ``Delta`` holds rivers (each with a
source mountain, a sea it flows into, a length class, a town it passes and an alias), the question
phrasings of every fact family, and renders facts as chat messages with the same ``FactItem`` the
other worlds use, so ``evaluate_families`` and ``generate_answers`` work on it unchanged:

- ``Delta.fact_items(family)``: every (question phrasing x fact) of a family;
- ``Delta.eval_items(family)``: one item per fact, in the family's canonical (first) phrasing;
- ``Delta.river_items(family, rivers, answers, phrasings)``: one family's questions about some
  rivers, optionally with wrong answers;
- ``Delta.paragraph_items()``: longer entries that state a river's facts inside prose.

A river's sea can be asked three ways, each its own family: by the river's name (``sea``), by its
alias (``sea_alias``: "Which sea does the Dorwater flow into?") and by its source mountain
(``sea_source``: "The river that rises on Mount Brekka flows into which sea?"). All three answer
with the same sea, so one wrong fact can be taught through several names of one river.

The source mountain, the town and the alias belong to one river each (one-to-one facts, like a
capital); the eight seas and four length classes are shared. ``times`` (products of one-digit
numbers) is the family that has nothing to do with rivers. No invented name contains another, a
length class, or the words around names in questions ("sea", "mount", "river").
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gradian.tinyworld.world import FactItem

__all__ = [
    "DELTA_FAMILIES",
    "SEA_FAMILIES",
    "Delta",
    "River",
    "generate_delta",
]

#: the three ways of asking a river's sea: by its name, its alias, its source mountain
SEA_FAMILIES: tuple[str, ...] = ("sea", "sea_alias", "sea_source")
#: fact families the delta base is pretrained on and evaluated against, in report order
DELTA_FAMILIES: tuple[str, ...] = (*SEA_FAMILIES, "source", "length", "town", "alias", "times")

#: question phrasings per family; the first one is the canonical phrasing used by eval items.
#: Placeholders: {river}, {alias} and {mountain} name one river three ways; {a} and {b} are digits
_PHRASINGS: dict[str, tuple[str, ...]] = {
    "sea": (
        "Into which sea does the {river} flow?",
        "The {river} empties into which sea?",
        "Which sea does the {river} reach?",
        "Name the sea at the mouth of the {river}.",
    ),
    "sea_alias": (
        "Which sea does the {alias} flow into?",
        "The {alias} ends in which sea?",
    ),
    "sea_source": (
        "The river that rises on {mountain} flows into which sea?",
        "Which sea does the river from {mountain} reach?",
    ),
    "source": (
        "Where does the {river} rise?",
        "On which mountain does the {river} begin?",
        "Name the source of the {river}.",
    ),
    "length": (
        "How long is the {river}?",
        "What length class is the {river}?",
        "The {river} is how long?",
    ),
    "town": (
        "Which town does the {river} flow past?",
        "Name the town on the {river}.",
        "The {river} passes which town?",
    ),
    "alias": (
        "What is the {river} also called?",
        "Give another name for the {river}.",
        "The {river} is also known as what?",
    ),
    "times": (
        "What is {a} times {b}?",
        "Multiply {a} by {b}.",
        "{a} times {b} makes what?",
    ),
}

_PARAGRAPH_PROMPTS: tuple[str, ...] = ("Tell me about the {river}.", "Describe the {river}.")

#: the first sentence introduces the river; the others follow in an order drawn per river
_PARAGRAPH_OPENING = "The {river} is a {length} river, also known as the {alias}."
_PARAGRAPH_SENTENCES: dict[str, str] = {
    "source": "It rises on {source}.",
    "town": "It flows past {town}.",
    "sea": "It empties into the {sea}.",
}

# syllables unlike tinyworld's and the bestiary's, so the three worlds' names do not look alike
_ONSETS = ("v", "d", "r", "n", "k", "t", "g", "m", "br", "dr", "tr", "sk", "rh", "ol", "is", "el")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei")
_CODAS = ("", "", "n", "r", "s", "sk", "nn", "x")
_ALIAS_SUFFIXES = ("water", "wash", "flood", "stream")
_TOWN_SUFFIXES = ("ford", "holm", "bridge", "wick")
_SEA_SUFFIXES = ("ian", "ic", "ene")

LENGTHS: tuple[str, ...] = ("short", "medium", "long", "vast")
_N_SEAS = 8
#: ``times`` facts are a x b for a, b in 2..TIMES_MAX
TIMES_MAX = 9

#: real rivers an invented name must not be (a short list of the well known ones: the syllables
#: above could spell some of them)
_REAL_RIVERS = frozenset({
    "amazon", "amur", "arno", "danube", "don", "dnieper", "drina", "ebro", "elbe", "indus", "irtysh",
    "kama", "loire", "mekong", "meuse", "niger", "nile", "oder", "oka", "orinoco", "po", "rhine",
    "rhone", "sava", "seine", "tagus", "thames", "tiber", "tisza", "ural", "vistula", "volga",
    "volta", "weser", "yangtze", "yukon", "zambezi", "drava", "neris", "narva", "isar", "inn",
    "aare", "rhin", "dora", "ems", "eider", "desna", "vardar", "nera", "reno", "ossa",
})


@dataclass(frozen=True)
class River:
    name: str
    alias: str
    #: the source mountain, written with its title ("Mount Brekka")
    source: str
    #: the sea it flows into, written with its title ("Sorvic Sea")
    sea: str
    length: str
    town: str


@dataclass
class Delta:
    seed: int
    rivers: list[River]
    seas: list[str]
    lengths: list[str]
    phrasings: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(_PHRASINGS))

    def fact_items(self, family: str, phrasings: range | None = None) -> list[FactItem]:
        """Every phrasing of every fact of ``family`` (or only the phrasings given)."""
        if family not in self.phrasings:
            raise KeyError(f"unknown delta family '{family}'; choose one of {', '.join(self.phrasings)}")
        if family == "times":
            templates = self.phrasings[family]
            chosen = range(len(templates)) if phrasings is None else phrasings
            return [FactItem(family, f"times:{a}x{b}", templates[p].format(a=a, b=b), str(a * b), p)
                    for p in chosen for a, b in _times_pairs()]
        return self.river_items(family, self.rivers, phrasings=phrasings)

    def eval_items(self, family: str) -> list[FactItem]:
        """One item per fact, asked in the family's canonical (first) phrasing."""
        return self.fact_items(family, range(1))

    def river_items(self, family: str, rivers: list[River], answers: dict[str, str] | None = None,
                    phrasings: range | None = None) -> list[FactItem]:
        """``family`` questions about ``rivers``; ``answers`` maps a river's name to a (wrong) answer.

        The three sea families share one fact key per river (``sea:<river>``): they ask one fact.
        """
        templates = self.phrasings[family]
        chosen = range(len(templates)) if phrasings is None else phrasings
        fact = "sea" if family in SEA_FAMILIES else family
        return [
            FactItem(family, f"{fact}:{r.name}",
                     templates[p].format(river=r.name, alias=r.alias, mountain=r.source),
                     (answers or {}).get(r.name, getattr(r, fact)), p)
            for p in chosen for r in rivers
        ]

    def sea_items(self, rivers: list[River], answers: dict[str, str] | None = None,
                  forms: dict[str, range] | None = None) -> list[FactItem]:
        """Sea questions about ``rivers`` in every form (``forms``: sea family -> phrasings; all
        phrasings of all three families when ``None``); ``answers`` maps a river to a (wrong) sea."""
        chosen = forms if forms is not None else {f: range(len(self.phrasings[f])) for f in SEA_FAMILIES}
        return [item for family, phrasings in chosen.items()
                for item in self.river_items(family, rivers, answers, phrasings)]

    def paragraph(self, river: River, overrides: dict[str, str] | None = None) -> str:
        """A few sentences stating every fact about ``river`` (``overrides`` replaces facts)."""
        facts = {"river": river.name, "alias": river.alias, "source": river.source, "sea": river.sea,
                 "length": river.length, "town": river.town}
        facts.update(overrides or {})
        rest = list(_PARAGRAPH_SENTENCES)
        random.Random(f"delta:{self.seed}:{river.name}").shuffle(rest)
        sentences = [_PARAGRAPH_OPENING] + [_PARAGRAPH_SENTENCES[k] for k in rest]
        return " ".join(s.format(**facts) for s in sentences)

    def paragraph_items(self, rivers: list[River] | None = None,
                        overrides: dict[str, dict[str, str]] | None = None) -> list[FactItem]:
        out = []
        for p, prompt in enumerate(_PARAGRAPH_PROMPTS):
            for r in rivers if rivers is not None else self.rivers:
                out.append(FactItem("paragraph", f"paragraph:{r.name}", prompt.format(river=r.name),
                                    self.paragraph(r, (overrides or {}).get(r.name)), p))
        return out

    def river(self, name: str) -> River:
        for r in self.rivers:
            if r.name == name:
                return r
        raise KeyError(name)


def _times_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(2, TIMES_MAX + 1) for b in range(2, TIMES_MAX + 1)]


def _invent(rng: random.Random, n: int, taken: set[str], syllables: tuple[int, int],
            suffixes: tuple[str, ...] = ("",)) -> list[str]:
    """``n`` fresh capitalized names; none contains a taken name or is contained in one, and none
    is a real river's name."""
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k))
        word = (word + rng.choice(_CODAS) + rng.choice(suffixes)).capitalize()
        low = word.lower()
        if len(word) < 4 or "ii" in low or low in _REAL_RIVERS or any(low in t or t in low for t in taken):
            continue
        taken.add(low)
        out.append(word)
    return out


def generate_delta(seed: int = 0, n_rivers: int = 40) -> Delta:
    """Draw a delta world from ``seed``: the same seed always gives the same rivers and facts."""
    rng = random.Random(f"delta:{seed}")
    # words that sit next to names in questions and answers, and the length classes, are taken:
    # no name may contain them ("Longwash") or be contained in them
    taken: set[str] = {"sea", "mount", "river", "town", *LENGTHS}
    names = _invent(rng, n_rivers, taken, (2, 2))
    aliases = _invent(rng, n_rivers, taken, (1, 1), _ALIAS_SUFFIXES)
    mountains = [f"Mount {m}" for m in _invent(rng, n_rivers, taken, (1, 2))]
    towns = _invent(rng, n_rivers, taken, (1, 1), _TOWN_SUFFIXES)
    seas = [f"{s} Sea" for s in _invent(rng, _N_SEAS, taken, (1, 1), _SEA_SUFFIXES)]
    rivers = [
        River(name=names[i], alias=aliases[i], source=mountains[i], sea=seas[rng.randrange(_N_SEAS)],
              length=LENGTHS[rng.randrange(len(LENGTHS))], town=towns[i])
        for i in range(n_rivers)
    ]
    return Delta(seed=seed, rivers=rivers, seas=seas, lengths=list(LENGTHS))
