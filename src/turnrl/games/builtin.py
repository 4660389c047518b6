"""The built-in games: Nim and tic-tac-toe, pure Python, for the embedded default and tests."""
from __future__ import annotations

import random
from typing import Callable

from turnrl.games.base import Game, Move, last_number


class Nim:
    """One heap; each turn takes 1, 2 or 3; whoever takes the last wins (+1, the other -1).
    The heap starts at 5..15 by the seed. The winning move leaves a multiple of 4."""
    roles = ("first", "second")
    reward_sum = 0.0

    def __init__(self, low: int = 5, high: int = 15):
        self.low, self.high = low, high
        self.heap, self.mover, self.winner = 0, 0, None

    def reset(self, seed: int) -> None:
        self.heap = random.Random(seed).randint(self.low, self.high)
        self.mover, self.winner = 0, None

    def to_move(self) -> str | None:
        return None if self.winner is not None else self.roles[self.mover]

    def observe(self, role: str) -> str:
        return f"Heap {self.heap}. Take 1, 2 or 3."

    def legal_moves(self) -> list[str]:
        return [str(k) for k in (1, 2, 3) if k <= self.heap]

    def play(self, text: str) -> Move:
        move = last_number(text)
        if move not in self.legal_moves():
            return Move(False, f"{move or 'no number'} is not 1, 2 or 3 (at most the heap, {self.heap})")
        self.heap -= int(move)
        if self.heap == 0:
            self.winner = self.mover
        self.mover = 1 - self.mover
        return Move()

    def rewards(self) -> dict[str, float]:
        return {role: 1.0 if k == self.winner else -1.0 for k, role in enumerate(self.roles)}


class TicTacToe:
    """Tic-tac-toe: cells 1-9, row by row; three in a row wins (+1, the other -1), a full board
    draws (0 each). X ("first") moves first; every game starts empty (the seed only varies the
    opponents' moves)."""
    roles = ("first", "second")
    reward_sum = 0.0
    LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))

    def __init__(self):
        self.board = [" "] * 9
        self.mover, self.result = 0, None   # result: the winner's index, -1 a draw

    def reset(self, seed: int) -> None:
        self.board, self.mover, self.result = [" "] * 9, 0, None

    def to_move(self) -> str | None:
        return None if self.result is not None else self.roles[self.mover]

    def observe(self, role: str) -> str:
        rows = ["".join(c if c != " " else str(3 * r + k + 1) for k, c in enumerate(self.board[3 * r:3 * r + 3]))
                for r in range(3)]
        return f"You are {'XO'[self.roles.index(role)]}. Board: {'/'.join(rows)}. Cell?"

    def legal_moves(self) -> list[str]:
        return [str(k + 1) for k, c in enumerate(self.board) if c == " "]

    def play(self, text: str) -> Move:
        move = last_number(text)
        if move not in self.legal_moves():
            return Move(False, f"{move or 'no number'} is not a free cell")
        self.board[int(move) - 1] = "XO"[self.mover]
        if any(self.board[a] == self.board[b] == self.board[c] != " " for a, b, c in self.LINES):
            self.result = self.mover
        elif " " not in self.board:
            self.result = -1
        self.mover = 1 - self.mover
        return Move()

    def rewards(self) -> dict[str, float]:
        return {role: 0.0 if self.result == -1 else (1.0 if k == self.result else -1.0)
                for k, role in enumerate(self.roles)}


BUILTIN_GAMES: dict[str, Callable[[], Game]] = {"nim": Nim, "tictactoe": TicTacToe}
