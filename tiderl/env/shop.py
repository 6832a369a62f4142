"""A small WebShop-like store: search, read a long results page, open an item, pick options, buy.

Pages (all plain words and numbers up to 1000, so they tokenize with the word-level tokenizer):

    search[query] → results page (8 items: id, name, price, rating, material, colors, sizes)
    click[ID]     → item page (description, price, color and size options)
    click[OPTION] → the option is selected (on an item page)
    back          → the last results page
    buy           → the episode ends; the reward scores the bought item against the task

The task (from ``reset``'s seed; a given ``task`` text is used as the seed's salt) asks for a
category, a material, a color, a size and a maximum price. Reward: the fraction of the five
wanted things the purchase satisfies (category, material, chosen color, chosen size, price within
budget), in [0, 1]. Buying nothing before the turn cap is 0. The catalog always holds an item
that satisfies all five; the scripted solver finds it in five actions.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from tiderl.env.base import Environment, StepResult

CATEGORIES = ("shirt", "shoes", "boots", "dress", "jacket", "pants", "jeans", "hat", "bag", "watch")
MATERIALS = ("cotton", "leather", "wool", "plastic", "metal", "wood", "glass", "steel")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "gray", "brown", "pink", "purple",
          "orange", "silver", "gold", "beige", "navy")
SIZES = ("small", "medium", "large")
AUDIENCES = ("men", "women", "kids", "unisex")
NUM_PRODUCTS = 120
NUM_RESULTS = 8
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Product:
    item_id: int
    category: str
    material: str
    audience: str
    price: int
    rating: int
    colors: tuple[str, ...]
    sizes: tuple[str, ...]

    @property
    def title(self) -> str:
        return f"{self.material} {self.category} for {self.audience}"

    def words(self) -> set[str]:
        return {self.category, self.material, self.audience, *self.colors, *self.sizes}


@dataclass(frozen=True)
class Goal:
    category: str
    material: str
    color: str
    size: str
    max_price: int

    @property
    def instruction(self) -> str:
        return (f"i want a {self.color} {self.material} {self.category} , size {self.size} , "
                f"and price lower than {self.max_price} dollars .")


def _random_product(rng: random.Random, item_id: int) -> Product:
    return Product(item_id, rng.choice(CATEGORIES), rng.choice(MATERIALS), rng.choice(AUDIENCES),
                   rng.randint(5, 300), rng.randint(1, 5),
                   tuple(rng.sample(COLORS, rng.randint(1, 4))),
                   tuple(sorted(rng.sample(SIZES, rng.randint(1, 3)), key=SIZES.index)))


def build_catalog(rng: random.Random) -> tuple[list[Product], Goal]:
    ids = rng.sample(range(1, 1001), NUM_PRODUCTS)
    products = [_random_product(rng, i) for i in ids]
    target = products[rng.randrange(NUM_PRODUCTS)]
    goal = Goal(target.category, target.material, rng.choice(target.colors),
                rng.choice(target.sizes), min(1000, target.price + rng.randint(1, 60)))
    return products, goal


class ShopEnv(Environment):
    name = "shop"

    def __init__(self, max_turns: int = 20):
        super().__init__(max_turns)
        self.products: dict[int, Product] = {}
        self.goal = Goal("", "", "", "", 0)
        self.turns = 0
        self.done = True
        self.results: list[Product] = []
        self.item: Product | None = None
        self.chosen: dict[str, str] = {}

    def reset(self, task: str | None, seed: int) -> tuple[str, dict[str, Any]]:
        rng = random.Random(f"{seed}:{task or ''}")
        products, self.goal = build_catalog(rng)
        self.products = {p.item_id: p for p in products}
        self.turns, self.done = 0, False
        self.results, self.item, self.chosen = [], None, {}
        observation = (f"welcome to the shop . task : {self.goal.instruction} "
                       "actions : search [ query ] , click [ item id ] , click [ option ] , "
                       "back , buy .")
        return observation, {"instruction": self.goal.instruction}

    # -- pages ------------------------------------------------------------------------------

    def _search(self, query: str) -> str:
        words = set(_WORD.findall(query.lower()))
        scored = sorted(self.products.values(),
                        key=lambda p: (-len(words & p.words()), p.price, p.item_id))
        self.results, self.item, self.chosen = scored[:NUM_RESULTS], None, {}
        lines = [f"results for your search . {len(self.results)} items ."]
        for p in self.results:
            lines.append(f"item {p.item_id} : {p.title} . price {p.price} dollars . rating "
                         f"{p.rating} stars . colors : {' , '.join(p.colors)} . sizes : "
                         f"{' , '.join(p.sizes)} .")
        return " ".join(lines)

    def _item_page(self, p: Product) -> str:
        self.item, self.chosen = p, {}
        return (f"item {p.item_id} : {p.title} . price {p.price} dollars . rating {p.rating} "
                f"stars . description : a {p.material} {p.category} for {p.audience} , made of "
                f"{p.material} . color options : {' , '.join(p.colors)} . size options : "
                f"{' , '.join(p.sizes)} . click an option , then buy , or go back .")

    def _click(self, arg: str) -> str:
        words = _WORD.findall(arg.lower())
        if self.item is not None:
            for w in words:
                if w in self.item.colors or w in self.item.sizes:
                    self.chosen["color" if w in COLORS else "size"] = w
                    return f"you selected {w} . selected : {' , '.join(self.chosen.values())} ."
        number = next((int(w) for w in words if w.isdigit()), None)
        if number is not None and any(p.item_id == number for p in self.results):
            return self._item_page(self.products[number])
        return "invalid click : no such item or option on this page ."

    def score(self) -> float:
        """The reward of buying the current item with the chosen options."""
        p, g = self.item, self.goal
        if p is None:
            return 0.0
        hits = [p.category == g.category, p.material == g.material,
                self.chosen.get("color") == g.color, self.chosen.get("size") == g.size,
                p.price <= g.max_price]
        return sum(hits) / len(hits)

    # -- step -------------------------------------------------------------------------------

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("the episode is over .", 0.0, True, {"turns": self.turns})
        self.turns += 1
        text = action.strip().lower()
        verb, _, rest = text.partition("[")
        verb = verb.strip() or text
        reward, done = 0.0, False
        if verb.startswith("search"):
            observation = self._search(rest.rstrip("]") or verb[len("search"):])
        elif verb.startswith("click"):
            observation = self._click(rest or verb[len("click"):])
        elif verb.startswith("back"):
            self.item, self.chosen = None, {}
            observation = "back to the results . search again or click an item ."
        elif verb.startswith("buy"):
            if self.item is None:
                observation = "you cannot buy here : click an item first ."
            else:
                reward, done = self.score(), True
                observation = f"you bought item {self.item.item_id} . score {round(100 * reward)} ."
        else:
            observation = "invalid action . use search [ query ] , click [ id ] , back or buy ."
        if not done and self.turns >= self.max_turns:
            done = True
            observation += " no turns left . you did not buy anything ."
        self.done = done
        return StepResult(observation, reward, done, {"turns": self.turns})

    def solve(self) -> str:
        g = self.goal
        if self.item is None:
            match = next((p for p in self.results if self._fits(p)), None)
            if match is None:
                return f"search [ {g.color} {g.material} {g.category} {g.size} ]"
            return f"click [ {match.item_id} ]"
        if not self._fits(self.item):
            return "back"
        if self.chosen.get("color") != g.color:
            return f"click [ {g.color} ]"
        if self.chosen.get("size") != g.size:
            return f"click [ {g.size} ]"
        return "buy"

    def _fits(self, p: Product) -> bool:
        g = self.goal
        return (p.category == g.category and p.material == g.material and g.color in p.colors
                and g.size in p.sizes and p.price <= g.max_price)
