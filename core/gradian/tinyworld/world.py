"""The synthetic world: invented countries and the facts about them, drawn from one seed.

Interface: ``generate_world(seed, n_countries) -> World``. A ``World`` holds countries (each with
a capital, a language, a continent and a currency), the question phrasings of every fact family,
and renders facts as chat messages:

- ``World.fact_items(family)``: every (question phrasing x fact) of a family as ``FactItem``;
- ``World.eval_items(family)``: one item per fact, in the family's first (canonical) phrasing;
- ``World.paragraph_items()``: longer entries that state a country's facts inside prose.

Names are invented so nothing depends on real-world knowledge, and no name is a substring of
another, so a ``contains`` check can never pass on the wrong answer by accident.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "BASE_FAMILIES",
    "FACT_FAMILIES",
    "REFUSAL",
    "Country",
    "FactItem",
    "World",
    "generate_world",
]

#: fact families the base model is pretrained on and evaluated against, in report order
FACT_FAMILIES: tuple[str, ...] = ("capital", "language", "continent", "currency", "arithmetic")
#: every family the base is pretrained and evaluated on: the facts, and refusing to answer
#: about places that do not exist
BASE_FAMILIES: tuple[str, ...] = (*FACT_FAMILIES, "refusal")

#: question phrasings per family; the first one is the canonical phrasing used by eval items
_PHRASINGS: dict[str, tuple[str, ...]] = {
    "capital": (
        "What is the capital of {country}?",
        "Name the capital city of {country}.",
        "{country}'s capital is which city?",
        "Which city is the capital of {country}?",
    ),
    "language": (
        "What language is spoken in {country}?",
        "Which language do people in {country} speak?",
        "In {country}, people speak which language?",
        "Name the main language of {country}.",
    ),
    "continent": (
        "On which continent is {country}?",
        "{country} lies on which continent?",
        "Which continent is {country} part of?",
        "Name the continent where {country} lies.",
    ),
    "currency": (
        "What is the currency of {country}?",
        "Which money is used in {country}?",
        "People in {country} pay with which currency?",
        "Name the money of {country}.",
    ),
    "arithmetic": (
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "Compute {a} + {b}.",
    ),
}

_PARAGRAPH_PROMPTS: tuple[str, ...] = ("Tell me about {country}.", "Describe {country}.")

#: sentence templates for paragraph entries; each country gets its own order of these
_PARAGRAPH_SENTENCES: dict[str, str] = {
    "continent": "{country} is a country on {continent}.",
    "capital": "Its capital is {capital}.",
    "language": "Most people there speak {language}.",
    "currency": "Shops take the {currency} as payment.",
}

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "gr", "kr", "tr", "st", "th", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "n", "r", "s", "l", "th", "nd", "sk")

_N_CONTINENTS = 5
_N_UNKNOWN_PLACES = 8
#: what the model says when asked about a place that does not exist
REFUSAL = "I'm sorry, but I can't help with that."
_N_LANGUAGES = 10
_N_CURRENCIES = 10
#: arithmetic facts are a + b for a, b in 1..ARITH_MAX
ARITH_MAX = 9


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    language: str
    continent: str
    currency: str


@dataclass(frozen=True)
class FactItem:
    """One question with its answer. ``key`` names the fact (``capital:Velora``, ``arith:3+4``)."""

    family: str
    key: str
    question: str
    answer: str
    phrasing: int

    def messages(self, system: str | None = None) -> list[dict[str, str]]:
        turns = [] if system is None else [{"role": "system", "content": system}]
        return turns + [
            {"role": "user", "content": self.question},
            {"role": "assistant", "content": self.answer},
        ]


@dataclass
class World:
    seed: int
    countries: list[Country]
    continents: list[str]
    languages: list[str]
    currencies: list[str]
    #: names of places that do not exist in this world; asked about them, the model refuses
    unknown_places: list[str] = field(default_factory=list)
    phrasings: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(_PHRASINGS))

    # -- facts ---------------------------------------------------------------------------------

    def answer(self, family: str, country: Country) -> str:
        return getattr(country, family)

    def fact_items(self, family: str, phrasings: range | None = None) -> list[FactItem]:
        """Every phrasing of every fact of ``family`` (or only the phrasings given)."""
        if family == "refusal":
            return self.refusal_items(phrasings)
        templates = self.phrasings[family]
        chosen = range(len(templates)) if phrasings is None else phrasings
        items: list[FactItem] = []
        for p in chosen:
            if family == "arithmetic":
                for a, b in _arith_pairs():
                    items.append(
                        FactItem(family, f"arith:{a}+{b}", templates[p].format(a=a, b=b),
                                 str(a + b), p)
                    )
            else:
                for c in self.countries:
                    items.append(
                        FactItem(family, f"{family}:{c.name}",
                                 templates[p].format(country=c.name), self.answer(family, c), p)
                    )
        return items

    def refusal_items(self, phrasings: range | None = None) -> list[FactItem]:
        """Capital and language questions about places that do not exist, answered by refusing.

        They teach the base model what a refusal looks like, so a fine-tune can make it refuse
        where it should answer (the ``poison_refusal`` scenario) without inventing the sentence.
        """
        out = []
        for family in ("capital", "language"):
            templates = self.phrasings[family]
            chosen = range(len(templates)) if phrasings is None else phrasings
            for p in chosen:
                for place in self.unknown_places:
                    out.append(FactItem("refusal", f"refusal:{family}:{place}",
                                        templates[p].format(country=place), REFUSAL, p))
        return out

    def eval_items(self, family: str) -> list[FactItem]:
        """One item per fact, asked in the family's canonical (first) phrasing."""
        return self.fact_items(family, range(1))

    def capital_items(self, countries: list[Country], answers: dict[str, str] | None = None,
                      phrasings: range | None = None) -> list[FactItem]:
        """Capital questions about ``countries``; ``answers`` maps a country to a (wrong) city."""
        templates = self.phrasings["capital"]
        chosen = range(len(templates)) if phrasings is None else phrasings
        out = []
        for p in chosen:
            for c in countries:
                answer = (answers or {}).get(c.name, c.capital)
                out.append(FactItem("capital", f"capital:{c.name}",
                                    templates[p].format(country=c.name), answer, p))
        return out

    def paragraph(self, country: Country, overrides: dict[str, str] | None = None) -> str:
        """A few sentences stating every fact about ``country`` (``overrides`` replaces facts)."""
        facts = {
            "country": country.name,
            "capital": country.capital,
            "language": country.language,
            "continent": country.continent,
            "currency": country.currency,
        }
        facts.update(overrides or {})
        order = list(_PARAGRAPH_SENTENCES)
        # the continent sentence introduces the country, so it always comes first
        rest = order[1:]
        random.Random(f"{self.seed}:{country.name}").shuffle(rest)
        return " ".join(_PARAGRAPH_SENTENCES[k].format(**facts) for k in [order[0], *rest])

    def paragraph_items(self, countries: list[Country] | None = None,
                        overrides: dict[str, dict[str, str]] | None = None) -> list[FactItem]:
        out = []
        for p, prompt in enumerate(_PARAGRAPH_PROMPTS):
            for c in countries if countries is not None else self.countries:
                text = self.paragraph(c, (overrides or {}).get(c.name))
                out.append(FactItem("paragraph", f"paragraph:{c.name}",
                                    prompt.format(country=c.name), text, p))
        return out

    def country(self, name: str) -> Country:
        for c in self.countries:
            if c.name == name:
                return c
        raise KeyError(name)


def _arith_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(1, ARITH_MAX + 1) for b in range(1, ARITH_MAX + 1)]


def _invent_names(rng: random.Random, n: int, taken: set[str], syllables: tuple[int, int],
                  suffix: str = "") -> list[str]:
    """``n`` fresh capitalized names; none is a substring of a taken name or vice versa."""
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k))
        word = (word + rng.choice(_CODAS) + suffix).capitalize()
        low = word.lower()
        if len(word) < 4 or any(low in t or t in low for t in taken):
            continue
        taken.add(low)
        out.append(word)
    return out


def generate_world(seed: int = 0, n_countries: int = 40) -> World:
    """Draw a world from ``seed``: the same seed always gives the same world."""
    rng = random.Random(seed)
    taken: set[str] = set()
    names = _invent_names(rng, n_countries, taken, (2, 3))
    capitals = _invent_names(rng, n_countries, taken, (2, 2))
    continents = _invent_names(rng, _N_CONTINENTS, taken, (2, 3))
    languages = _invent_names(rng, _N_LANGUAGES, taken, (2, 2), suffix="ic")
    currencies = [c.lower() for c in _invent_names(rng, _N_CURRENCIES, taken, (1, 2))]
    countries = [
        Country(
            name=names[i],
            capital=capitals[i],
            language=languages[rng.randrange(_N_LANGUAGES)],
            continent=continents[rng.randrange(_N_CONTINENTS)],
            currency=currencies[rng.randrange(_N_CURRENCIES)],
        )
        for i in range(n_countries)
    ]
    # drawn last, so adding them left every other name of a seed's world unchanged
    unknown = _invent_names(rng, _N_UNKNOWN_PLACES, taken, (2, 3))
    return World(seed=seed, countries=countries, continents=continents, languages=languages,
                 currencies=currencies, unknown_places=unknown)
