"""Loss and eval-loss curves of a run's attempts, drawn as terminal text or as a PNG, with no plotting
library: a terminal has Unicode, and a PNG is a zlib stream of pixel rows (the standard library has both)."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fsdp_trainer.contract import ProgressRecord

TEXT_WIDTH = 72
TEXT_HEIGHT = 16
Point = tuple[int, float]


@dataclass(frozen=True)
class Attempt:
    loss: list[Point] = field(default_factory=list)
    eval_loss: list[Point] = field(default_factory=list)
    resumed_from_step: int | None = None  # where a restarted attempt picked up


@dataclass(frozen=True)
class Curves:
    attempts: list[Attempt]

    @property
    def loss(self) -> list[Point]:
        return [point for attempt in self.attempts for point in attempt.loss]

    @property
    def restarts(self) -> list[int]:
        """The step at which each attempt after the first began: a restart."""
        starts = []
        for attempt in self.attempts[1:]:
            first = attempt.resumed_from_step
            if first is None and attempt.loss:
                first = attempt.loss[0][0]
            starts.append(first or 0)
        return starts

    def points(self) -> Iterable[Point]:
        for attempt in self.attempts:
            yield from attempt.loss
            yield from attempt.eval_loss


def curves(histories: Sequence[Sequence[ProgressRecord]]) -> Curves:
    """Each attempt's loss at every logged step and its eval loss whenever it changed."""
    attempts = []
    for records in histories:
        loss: list[Point] = []
        evals: list[Point] = []
        resumed = None
        for record in records:
            resumed = record.resumed_from_step if record.resumed_from_step is not None else resumed
            if (
                record.phase == "training"
                and record.loss is not None
                and (not loss or loss[-1][0] != record.step)
            ):
                loss.append((record.step, record.loss))
            if record.eval_loss is not None and (not evals or evals[-1][1] != record.eval_loss):
                evals.append((record.step, record.eval_loss))
        attempts.append(Attempt(loss, evals, resumed))
    return Curves(attempts)


@dataclass(frozen=True)
class _Scale:
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> _Scale:
        finite = [v for v in values if math.isfinite(v)]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        if high - low < 1e-12:
            low, high = low - 0.5, high + 0.5
        return cls(low, high)

    def fraction(self, value: float) -> float:
        return (value - self.low) / (self.high - self.low)


def _scales(data: Curves) -> tuple[_Scale, _Scale]:
    points = list(data.points())
    return _Scale.of(float(s) for s, _ in points), _Scale.of(v for _, v in points)


# -- terminal ---------------------------------------------------------------------------------------------

LOSS_MARK, EVAL_MARK, RESTART_MARK = "•", "◆", "┆"


def text(data: Curves, width: int = TEXT_WIDTH, height: int = TEXT_HEIGHT) -> str:
    """A character plot: • loss, ◆ eval loss, ┆ a restart (the step the attempt resumed from)."""
    width, height = max(width, 20), max(height, 4)
    xs, ys = _scales(data)
    grid = [[" "] * width for _ in range(height)]

    def column(step: float) -> int:
        return min(width - 1, max(0, round(xs.fraction(step) * (width - 1))))

    def row(value: float) -> int:
        return min(height - 1, max(0, height - 1 - round(ys.fraction(value) * (height - 1))))

    for step in data.restarts:
        for line in grid:
            line[column(step)] = RESTART_MARK
    for attempt in data.attempts:
        for step, value in attempt.loss:
            grid[row(value)][column(step)] = LOSS_MARK
    for attempt in data.attempts:
        for step, value in attempt.eval_loss:
            grid[row(value)][column(step)] = EVAL_MARK
    label_width = 9
    lines = []
    for index, line in enumerate(grid):
        value = ys.high - (ys.high - ys.low) * index / (height - 1)
        label = f"{value:.4g}" if index in (0, height // 2, height - 1) else ""
        lines.append(f"{label:>{label_width}} ┤{''.join(line)}")
    lines.append(" " * label_width + " └" + "─" * width)
    low, high = f"step {xs.low:.0f}", f"{xs.high:.0f}"
    lines.append(" " * (label_width + 2) + low + high.rjust(width - len(low)))
    restarts = ", ".join(str(step) for step in data.restarts) or "none"
    lines.append(f"{LOSS_MARK} loss   {EVAL_MARK} eval loss   {RESTART_MARK} restart (from step {restarts})")
    return "\n".join(lines) + "\n"


# -- PNG --------------------------------------------------------------------------------------------------

WIDTH, HEIGHT = 900, 450
LEFT, RIGHT, TOP, BOTTOM = 80, 20, 40, 50
WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (200, 200, 200)
LOSS_COLOUR, EVAL_COLOUR, RESTART_COLOUR = (31, 119, 180), (255, 127, 14), (214, 39, 40)
Colour = tuple[int, int, int]

# 3x5 glyphs (rows of 3 bits) for the labels the plot writes.
GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "e": "000111101110011", "l": "010010010010011", "o": "000111101101111", "s": "000011110001110",
    "v": "000101101101010", "a": "000011101101011", "r": "000110101100100", "t": "010111010010011",
    "p": "000111101111100", "f": "011010111010010", "m": "000111111101101", "+": "000010111010000",
    " ": "000000000000000",
}  # fmt: skip


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, colour: Colour, size: int = 1) -> None:
        for dx in range(-(size // 2), size - size // 2):
            for dy in range(-(size // 2), size - size // 2):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    at = 3 * (py * self.width + px)
                    self.pixels[at : at + 3] = bytes(colour)

    def line(self, start: tuple[int, int], end: tuple[int, int], colour: Colour, size: int = 2) -> None:
        (x0, y0), (x1, y1) = start, end
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), colour, size)

    def label(self, x: int, y: int, words: str, colour: Colour = BLACK, scale: int = 2) -> None:
        for index, char in enumerate(words):
            bits = GLYPHS.get(char, GLYPHS[" "])
            for bit, on in enumerate(bits):
                if on == "1":
                    for sx in range(scale):
                        for sy in range(scale):
                            self.dot(
                                x + index * 4 * scale + (bit % 3) * scale + sx,
                                y + (bit // 3) * scale + sy,
                                colour,
                            )

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * self.width * y : 3 * self.width * (y + 1)])
            for y in range(self.height)
        )

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows, 9))
            + chunk(b"IEND", b"")
        )


def png(data: Curves) -> bytes:
    """The curves as a PNG: loss lines (blue), eval-loss points (orange), restarts (red dashed lines)."""
    canvas = _Canvas(WIDTH, HEIGHT)
    xs, ys = _scales(data)
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(step: float, value: float) -> tuple[int, int]:
        return LEFT + round(xs.fraction(step) * plot_width), TOP + round(
            (1 - ys.fraction(value)) * plot_height
        )

    for tick in range(5):
        value = ys.low + (ys.high - ys.low) * tick / 4
        _, y = at(xs.low, value)
        canvas.line((LEFT, y), (LEFT + plot_width, y), GREY, 1)
        canvas.label(8, y - 5, f"{value:.3g}")
        step = xs.low + (xs.high - xs.low) * tick / 4
        x, _ = at(step, ys.low)
        canvas.label(x - 12, TOP + plot_height + 12, f"{step:.0f}")
    canvas.line((LEFT, TOP), (LEFT, TOP + plot_height), BLACK, 2)
    canvas.line((LEFT, TOP + plot_height), (LEFT + plot_width, TOP + plot_height), BLACK, 2)
    canvas.label(LEFT + plot_width // 2 - 16, HEIGHT - 18, "step")
    for step in data.restarts:
        x, _ = at(step, ys.low)
        for y in range(TOP, TOP + plot_height, 12):
            canvas.line((x, y), (x, y + 6), RESTART_COLOUR, 2)
    for attempt in data.attempts:
        for start, end in zip(attempt.loss, attempt.loss[1:], strict=False):
            canvas.line(at(*start), at(*end), LOSS_COLOUR, 2)
        if len(attempt.loss) == 1:
            canvas.dot(*at(*attempt.loss[0]), LOSS_COLOUR, 5)
        for point in attempt.eval_loss:
            canvas.dot(*at(*point), EVAL_COLOUR, 9)
    x = LEFT + plot_width - 330
    for colour, words in ((LOSS_COLOUR, "loss"), (EVAL_COLOUR, "eval loss"), (RESTART_COLOUR, "restart")):
        canvas.line((x, 16), (x + 20, 16), colour, 4)
        canvas.label(x + 26, 11, words)
        x += 26 + len(words) * 8 + 24
    return canvas.png()


@dataclass(frozen=True)
class LossCurve:
    """The curves as Jupyter shows them (a PNG) and as print() does (the terminal drawing)."""

    curves: Curves

    def _repr_png_(self) -> bytes:
        return png(self.curves)

    def __str__(self) -> str:
        return text(self.curves)
