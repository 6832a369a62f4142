"""An ALFWorld-like household: receptacles in a room, objects in them, a put-something task.

Actions (lenient: lower-cased, extra words ignored, "mug" means the first mug that fits)::

    look | inventory | go to R | open R | close R | take O from R | put O in R | put O on R
    clean O with sinkbasin | heat O with microwave | cool O with fridge | examine R

Tasks: "put a mug in cabinet", "put a clean mug in cabinet", "put a hot ..." or "put a cool ..."
(clean at a sinkbasin, heat in a microwave, cool in a fridge while holding the object). The
layout (4 to 6 searchable receptacles, some closed, plus the appliances) comes from the seed; a
given ``task`` text salts the seed. Reward: 1 when an object of the asked kind, in the asked
state, is put in a receptacle of the asked kind; 0 when the turn cap ends the episode.

The scripted solver searches like an agent that knows nothing: it visits receptacles in the
order ``look`` lists them, opening closed ones, until it sees the object; it then cleans, heats
or cools it and puts it away. It needs 4 to 18 actions depending on the layout.
"""

from __future__ import annotations

import random
import re
from typing import Any

from tiderl.env.base import Environment, StepResult

ROOMS = ("kitchen", "bedroom", "livingroom", "bathroom", "office")
SEARCHABLE = ("cabinet", "drawer", "shelf", "countertop", "table", "desk", "dresser", "sidetable",
              "safe", "box")
CLOSED_KINDS = {"cabinet", "drawer", "safe", "box", "fridge", "microwave"}
OBJECTS = ("mug", "cup", "apple", "bread", "egg", "tomato", "potato", "knife", "spoon", "plate",
           "bowl", "pan", "bottle", "vase", "book", "pen", "cloth", "candle")
STATES = {"clean": "sinkbasin", "hot": "microwave", "cool": "fridge"}
_VERB_STATE = {"clean": "clean", "heat": "hot", "cool": "cool"}
_WORD = re.compile(r"[a-z]+|\d+")


class HouseholdEnv(Environment):
    name = "household"

    def __init__(self, max_turns: int = 20):
        super().__init__(max_turns)
        self.turns, self.done = 0, True
        self.room = ""
        self.contents: dict[str, list[str]] = {}  # receptacle -> objects in it
        self.closed: set[str] = set()
        self.states: dict[str, set[str]] = {}  # object -> {"clean", "hot", ...}
        self.at = ""
        self.holding: str | None = None
        self.want = ("", "", "")  # (state or "", object kind, receptacle kind)
        self._plan_index = 0

    # -- layout -----------------------------------------------------------------------------

    def reset(self, task: str | None, seed: int) -> tuple[str, dict[str, Any]]:
        rng = random.Random(f"{seed}:{task or ''}")
        self.room = rng.choice(ROOMS)
        kinds = rng.sample(SEARCHABLE, rng.randint(3, 5))
        receptacles = [f"{k} 1" for k in kinds] + [f"{rng.choice(kinds)} 2"]
        rng.shuffle(receptacles)
        receptacles += ["sinkbasin 1", "microwave 1", "fridge 1"]
        self.contents = {r: [] for r in receptacles}
        self.closed = {r for r in receptacles if r.split()[0] in CLOSED_KINDS}
        kind = rng.choice(OBJECTS)
        state = rng.choice(("", "", *STATES))
        searchable = receptacles[:-3]
        goal_kind = rng.choice(sorted({r.split()[0] for r in searchable}))
        source = rng.choice([r for r in searchable if not r.startswith(goal_kind)])
        self.contents[source].append(f"{kind} 1")
        for other in rng.sample([o for o in OBJECTS if o != kind], 4):
            self.contents[rng.choice(searchable)].append(f"{other} 1")
        self.states = {o: set() for objs in self.contents.values() for o in objs}
        self.want = (state, kind, goal_kind)
        self.at, self.holding = "", None
        self.turns, self.done, self._plan_index = 0, False, 0
        prep = "on" if goal_kind in {"countertop", "table", "desk", "shelf", "sidetable",
                                     "dresser"} else "in"
        task_text = f"put a {state + ' ' if state else ''}{kind} {prep} {goal_kind}"
        observation = f"you are in the {self.room} . {self._look()} your task is to : {task_text} ."
        return observation, {"task": task_text, "receptacles": receptacles}

    def _look(self) -> str:
        where = f"you are at {self.at} . " if self.at else ""
        return f"{where}around you , you see {' , '.join(f'a {r}' for r in self.contents)} ."

    def _show(self, r: str) -> str:
        if r in self.closed:
            return f"the {r} is closed ."
        things = self.contents[r]
        return f"on the {r} , you see {' , '.join(f'a {o}' for o in things) or 'nothing'} ."

    # -- parsing ----------------------------------------------------------------------------

    def _find(self, words: list[str], names: list[str]) -> str | None:
        """The first of ``names`` whose kind (and number, if given) appears in ``words``."""
        for i, w in enumerate(words):
            number = words[i + 1] if i + 1 < len(words) and words[i + 1].isdigit() else None
            for name in names:
                kind, n = name.split()
                if kind == w and number in (None, n):
                    return name
        return None

    def _do(self, action: str) -> str:
        words = _WORD.findall(action.lower())
        if not words:
            return "nothing happens . try look ."
        verb, args = words[0], words[1:]
        receptacles = list(self.contents)
        if verb == "look":
            return self._look()
        if verb == "inventory":
            return f"you are carrying : {f'a {self.holding}' if self.holding else 'nothing'} ."
        if verb in {"go", "examine", "open", "close"}:
            r = self._find(args, receptacles)
            if r is None:
                return "nothing happens . no such place ."
            if verb in {"go", "examine"}:
                self.at = r
                return f"you arrive at {r} . {self._show(r)}"
            if self.at != r:
                return f"nothing happens . go to {r} first ."
            if r.split()[0] not in CLOSED_KINDS:
                return f"nothing happens . the {r} cannot open or close ."
            (self.closed.add if verb == "close" else self.closed.discard)(r)
            return f"you {'close' if verb == 'close' else 'open'} the {r} . {self._show(r)}"
        if verb == "take":
            return self._take(args)
        if verb == "put":
            return self._put(args)
        if verb in _VERB_STATE:
            return self._treat(verb, args)
        return "nothing happens . that action is not valid here ."

    def _take(self, args: list[str]) -> str:
        if self.holding:
            return f"nothing happens . you are holding a {self.holding} ."
        if not self.at or self.at in self.closed:
            return "nothing happens . you see no such thing here ."
        o = self._find(args, self.contents[self.at])
        if o is None:
            return "nothing happens . you see no such thing here ."
        self.contents[self.at].remove(o)
        self.holding = o
        return f"you take the {o} from the {self.at} ."

    def _put(self, args: list[str]) -> str:
        if self.holding is None or self._find(args, [self.holding]) is None:
            return "nothing happens . you are not holding that ."
        if not self.at or self.at in self.closed:
            return "nothing happens . go to an open place first ."
        o, self.holding = self.holding, None
        self.contents[self.at].append(o)
        return f"you put the {o} in / on the {self.at} ."

    def _treat(self, verb: str, args: list[str]) -> str:
        state = _VERB_STATE[verb]
        if self.holding is None or self._find(args, [self.holding]) is None:
            return "nothing happens . you are not holding that ."
        if not self.at.startswith(STATES[state]):
            return f"nothing happens . you need to be at the {STATES[state]} ."
        self.states[self.holding].add(state)
        return f"you {verb} the {self.holding} using the {self.at} ."

    def is_success(self) -> bool:
        state, kind, goal_kind = self.want
        return any(o.split()[0] == kind and (not state or state in self.states[o])
                   for r, objs in self.contents.items() if r.split()[0] == goal_kind
                   for o in objs)

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("the episode is over .", 0.0, True, {"turns": self.turns})
        self.turns += 1
        observation = self._do(action)
        if self.is_success():
            self.done = True
            return StepResult(observation + " task done !", 1.0, True,
                              {"turns": self.turns, "won": True})
        if self.turns >= self.max_turns:
            self.done = True
            return StepResult(observation + " no turns left .", 0.0, True,
                              {"turns": self.turns, "won": False})
        return StepResult(observation, 0.0, False, {"turns": self.turns})

    def solve(self) -> str:
        state, kind, goal_kind = self.want
        if self.holding is not None:
            if state and state not in self.states[self.holding]:
                appliance = f"{STATES[state]} 1"
                if self.at != appliance:
                    return f"go to {appliance}"
                verb = next(v for v, s in _VERB_STATE.items() if s == state)
                return f"{verb} {self.holding} with {appliance}"
            goal = next(r for r in self.contents if r.split()[0] == goal_kind)
            if self.at != goal:
                return f"go to {goal}"
            if goal in self.closed:
                return f"open {goal}"
            return f"put {self.holding} in {goal}"
        order = [r for r in self.contents if r.split()[0] not in STATES.values()]
        current = order[min(self._plan_index, len(order) - 1)]
        if self.at != current:
            return f"go to {current}"
        if current in self.closed:
            return f"open {current}"
        found = next((o for o in self.contents[current] if o.split()[0] == kind), None)
        if found is not None:
            return f"take {found} from {current}"
        self._plan_index += 1
        return f"go to {order[min(self._plan_index, len(order) - 1)]}"
