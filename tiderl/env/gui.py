"""A GUI-like environment: screenshots in, clicks and typing out (a small OSWorld).

Every observation is a rendered screenshot, a PNG of ``WIDTH`` x ``HEIGHT`` = 140 x 112 pixels
(5 x 4 cells of 28 pixels: whole merged patches of a Qwen2-VL-style model, patch 14, merge 2),
and a short text. Widgets are drawn in named colors (one widget per color), each in a cell;
an OK button holds the bottom-right cell:

    click task   "Click the red, blue and green buttons in this order, then click OK."
                 buttons in random cells; a pressed button stays pressed (dark, a white dot)
    form task    'Type "lamp" in the text field, tick the red and blue boxes, then click OK.'
                 a text field across the top row, checkboxes in random cells below

Actions, found anywhere in the model's text (the first one counts, one a turn):
``click(x, y)`` clicks pixel (x, y), x from the left edge and y from the top: a button is
pressed, a box toggles, the field takes focus, OK submits; ``type("text")`` replaces the
focused field's text (at most ``MAX_FIELD_CHARS`` printable ASCII characters, ``\\"`` and
``\\\\`` escaped). Anything else (no action, a click on nothing, typing without a focused field)
costs a turn and is told so.

Reward, when OK is clicked or at the turn cap, is the fraction of the task's checks the screen
passes. Click task: one check per asked button, position i passed when the i-th button pressed
is the i-th asked (pressing them out of order earns the positions that still match). Form task:
one check for the field holding the word, one per asked box ticked, each ticked box not asked
cancelling one passed check (never below 0).

Task text: its first integer is the number of buttons or boxes asked (1 to 4; none: drawn), and
"click" or "form" picks the kind (neither: drawn). ``random.Random`` seeded by the task text and
the seed draws the rest (kind, count, layout, colors, word), so (task, seed) fixes the episode.

Rendering draws on a 140 x 112 canvas with Pillow and encodes a PNG, about a millisecond; the same
screen gives the same bytes (for one Pillow and zlib build). The environment answers at once: its
step latency is the service's model (``env.step_latency``; docs/environments.md gives an
OSWorld-like heavy-tailed setting).

Scripted solver: click the asked buttons in order; or focus the field, type the word and tick the
asked boxes; then OK (at most 7 actions).
"""

from __future__ import annotations

import functools
import io
import random
import re
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from tiderl.env.base import Environment, StepResult
from tiderl.env.protocol import Message, TextPart, image_part

WIDTH, HEIGHT, CELL = 140, 112, 28
COLUMNS, ROWS = WIDTH // CELL, HEIGHT // CELL
OK_CELL = (COLUMNS - 1, ROWS - 1)
FIELD_BOX = (4, 4, 107, 23)  # the form's text field: the top row's first four cells
MAX_FIELD_CHARS = 12
MAX_ASKED = 4
KINDS = ("click", "form")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 90, 220),
    "yellow": (240, 200, 30), "purple": (140, 60, 180), "orange": (245, 130, 30),
    "pink": (240, 120, 190), "brown": (130, 80, 40),
}
WORDS = ("cat", "dog", "sun", "map", "box", "tree", "lamp", "fish", "bird", "moon", "star",
         "rain")
BACKGROUND, INK, PANEL = (240, 240, 240), (30, 30, 30), (200, 200, 200)
SYSTEM_PROMPT = (f"You operate a graphical interface through screenshots of {WIDTH}x{HEIGHT} "
                 "pixels. Give one action a turn: click(x, y) clicks the pixel x from the left "
                 "edge and y from the top; type(\"text\") replaces the text of the focused text "
                 "field. Click OK when the task is done.")

_CLICK = re.compile(r"\bclick\s*\(\s*(\d{1,6})\s*,\s*(\d{1,6})\s*\)", re.IGNORECASE)
_TYPE = re.compile(r"""\btype\s*\(\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')\s*\)""",
                   re.IGNORECASE | re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_INT = re.compile(r"\d+")


@dataclass
class Widget:
    """One thing on the screen: ``kind`` button, checkbox, field or ok; ``is_on``: a button
    pressed, a box ticked."""

    kind: str
    color: str  # a COLORS name; "" for the field and OK
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1), inclusive
    is_on: bool = False

    def contains(self, x: int, y: int) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 <= x <= x1 and y0 <= y <= y1

    @property
    def center(self) -> tuple[int, int]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) // 2, (y0 + y1) // 2


@dataclass
class Screen:
    """The episode's state: what is drawn, and what the task asks."""

    kind: str
    asked: list[str]  # colors, in the order asked
    word: str  # the form's word ("" for a click task)
    widgets: list[Widget]
    field_text: str = ""
    is_focused: bool = False
    pressed: list[str] = field(default_factory=list)  # button colors, in pressed order

    @property
    def num_checks(self) -> int:
        return len(self.asked) + (self.kind == "form")

    def checks_passed(self) -> int:
        if self.kind == "click":
            return sum(a == p for a, p in zip(self.asked, self.pressed, strict=False))
        ticked = {w.color for w in self.widgets if w.kind == "checkbox" and w.is_on}
        passed = (self.field_text == self.word) + len(ticked & set(self.asked))
        return max(0, passed - len(ticked - set(self.asked)))


def cell_box(cell: tuple[int, int], inset: int) -> tuple[int, int, int, int]:
    column, row = cell
    return (column * CELL + inset, row * CELL + inset,
            (column + 1) * CELL - 1 - inset, (row + 1) * CELL - 1 - inset)


def make_screen(task: str | None, seed: int) -> Screen:
    """The episode (task, seed) names (see the module docstring)."""
    rng = random.Random(f"gui|{task or ''}|{seed}")
    text = (task or "").lower()
    kinds = [kind for kind in KINDS if kind in text] or list(KINDS)
    kind = rng.choice(kinds)
    number = _INT.search(text)
    num_asked = min(max(int(number.group()), 1), MAX_ASKED) if number else \
        rng.randint(1, MAX_ASKED)
    num_shown = num_asked + rng.randint(1, 3 if kind == "click" else 2)
    colors = rng.sample(sorted(COLORS), num_shown)
    first_row = 0 if kind == "click" else 1
    free = [(c, r) for r in range(first_row, ROWS) for c in range(COLUMNS) if (c, r) != OK_CELL]
    cells = rng.sample(free, num_shown)
    widget_kind, inset = ("button", 4) if kind == "click" else ("checkbox", 6)
    widgets = [Widget(widget_kind, color, cell_box(cell, inset))
               for color, cell in zip(colors, cells, strict=True)]
    widgets.append(Widget("ok", "", cell_box(OK_CELL, 3)))
    if kind == "form":
        widgets.append(Widget("field", "", FIELD_BOX))
    word = rng.choice(WORDS) if kind == "form" else ""
    return Screen(kind, rng.sample(colors, num_asked), word, widgets)


def instruction(screen: Screen) -> str:
    names = screen.asked[0] if len(screen.asked) == 1 else (
        f"{', '.join(screen.asked[:-1])} and {screen.asked[-1]}")
    if screen.kind == "click":
        order = " in this order" if len(screen.asked) > 1 else ""
        noun = "buttons" if len(screen.asked) > 1 else "button"
        return f"Click the {names} {noun}{order}, then click OK."
    noun = "boxes" if len(screen.asked) > 1 else "box"
    return f'Type "{screen.word}" in the text field, tick the {names} {noun}, then click OK.'


@functools.cache
def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()


def render(screen: Screen) -> bytes:
    """The screenshot of ``screen``: PNG bytes, ``WIDTH`` x ``HEIGHT``, RGB."""
    image = Image.new("RGB", (WIDTH, HEIGHT), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for widget in screen.widgets:
        _draw_widget(draw, widget, screen)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _draw_widget(draw: ImageDraw.ImageDraw, widget: Widget, screen: Screen) -> None:
    x0, y0, x1, y1 = box = widget.box
    if widget.kind == "button":
        color = COLORS[widget.color]
        if widget.is_on:
            color = tuple(c // 2 for c in color)
        draw.rounded_rectangle(box, radius=4, fill=color, outline=INK,
                               width=3 if widget.is_on else 1)
        if widget.is_on:
            cx, cy = widget.center
            draw.ellipse((cx - 3, cy - 3, cx + 3, cy + 3), fill=(255, 255, 255))
    elif widget.kind == "checkbox":
        draw.rectangle(box, fill=COLORS[widget.color] if widget.is_on else (255, 255, 255),
                       outline=COLORS[widget.color], width=3)
        if widget.is_on:
            draw.line((x0 + 3, y0 + 8, x0 + 6, y1 - 3, x1 - 3, y0 + 3), fill=INK, width=2)
    elif widget.kind == "field":
        draw.rectangle(box, fill=(255, 255, 255), outline=(40, 90, 220) if screen.is_focused
                       else (120, 120, 120), width=2 if screen.is_focused else 1)
        draw.text((x0 + 3, y0 + 3), screen.field_text, fill=INK, font=_font())
    else:  # ok
        draw.rounded_rectangle(box, radius=3, fill=PANEL, outline=INK)
        left, top, right, bottom = draw.textbbox((0, 0), "OK", font=_font())
        cx, cy = widget.center
        draw.text((cx - (left + right) // 2, cy - (top + bottom) // 2), "OK", fill=INK,
                  font=_font())


def parse_action(text: str) -> tuple[str, Any] | None:
    """The first action in ``text``: ("click", (x, y)), ("type", text) or None."""
    click, typed = _CLICK.search(text), _TYPE.search(text)
    if click and (typed is None or click.start() < typed.start()):
        return "click", (int(click.group(1)), int(click.group(2)))
    if typed:
        raw = typed.group(1) if typed.group(1) is not None else typed.group(2)
        return "type", _ESCAPE.sub(r"\1", raw)
    return None


class GuiEnv(Environment):
    name = "gui"
    is_word_level = False  # instructions and actions are ordinary text, for a VLM's tokenizer

    def __init__(self, max_turns: int = 20):
        super().__init__(max_turns)
        self.screen = Screen("click", [], "", [])
        self.turns = 0
        self.done = True

    def reset(self, task: str | None, seed: int) -> tuple[list[Message], dict[str, Any]]:
        self.screen = make_screen(task, seed)
        self.turns = 0
        self.done = False
        info = {"kind": self.screen.kind, "num_checks": self.screen.num_checks,
                "width": WIDTH, "height": HEIGHT}
        return [Message(role="system", content=SYSTEM_PROMPT),
                self._shot(instruction(self.screen))], info

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult([Message(role="user", content="The episode is over.")], 0.0, True,
                              {"turns": self.turns})
        self.turns += 1
        feedback, submitted = self._act(parse_action(action))
        if submitted or self.turns >= self.max_turns:
            return self._finish(feedback, submitted)
        left = self.max_turns - self.turns
        return StepResult([self._shot(f"{feedback} {left} turns left.")], 0.0, False,
                          {"turns": self.turns})

    def _act(self, action: tuple[str, Any] | None) -> tuple[str, bool]:
        """The feedback text of one action, and whether it submitted."""
        if action is None:
            return 'No action found: write click(x, y) or type("text").', False
        kind, value = action
        if kind == "type":
            return self._type(value), False
        x, y = value
        widget = next((w for w in self.screen.widgets if w.contains(x, y)), None)
        self.screen.is_focused = widget is not None and widget.kind == "field"
        if widget is None:
            return f"Nothing there at ({x}, {y}).", False
        if widget.kind == "ok":
            return "Submitted.", True
        if widget.kind == "field":
            return "The text field has focus.", False
        if widget.kind == "checkbox":
            widget.is_on = not widget.is_on
            return ("Ticked a box." if widget.is_on else "Unticked a box."), False
        if widget.is_on:
            return "That button is already pressed.", False
        widget.is_on = True
        self.screen.pressed.append(widget.color)
        return "Pressed a button.", False

    def _type(self, text: str) -> str:
        if self.screen.kind != "form":
            return "There is no text field on this screen."
        if not self.screen.is_focused:
            return "No text field has focus: click it first."
        if len(text) > MAX_FIELD_CHARS or not all(" " <= c <= "~" for c in text):
            return f"Type at most {MAX_FIELD_CHARS} printable ASCII characters."
        self.screen.field_text = text
        return f'The text field reads "{text}".'

    def _finish(self, feedback: str, submitted: bool) -> StepResult:
        self.done = True
        passed, total = self.screen.checks_passed(), self.screen.num_checks
        ending = "" if submitted else " No turns left."
        text = f"{feedback}{ending} {passed} of {total} checks passed."
        info = {"turns": self.turns, "checks_passed": passed, "num_checks": total,
                "submitted": submitted, "truncated": not submitted}
        return StepResult([self._shot(text)], passed / total, True, info)

    def _shot(self, text: str) -> Message:
        return Message(role="user", content=[image_part(render(self.screen)), TextPart(text)])

    def solve(self) -> str:
        screen = self.screen
        by_color = {w.color: w for w in screen.widgets if w.color}
        ok = next(w for w in screen.widgets if w.kind == "ok")
        if screen.kind == "click":
            remaining = [c for c in screen.asked if c not in screen.pressed]
            target = by_color[remaining[0]] if remaining else ok
            return "click({}, {})".format(*target.center)
        if screen.field_text != screen.word:
            if not screen.is_focused:
                return "click({}, {})".format(*next(
                    w for w in screen.widgets if w.kind == "field").center)
            return f'type("{screen.word}")'
        unticked = [c for c in screen.asked if not by_color[c].is_on]
        target = by_color[unticked[0]] if unticked else ok
        return "click({}, {})".format(*target.center)
