"""The calc task as a verifiers v1 environment, written as a verifiers user writes one: a taskset
of rows, a task that scores the trace, a tool server (``calc_evaluate``) its harness calls over
MCP (one for the taskset: the tool keeps no state). The same problems, tool and scoring as the
built-in ``calc`` environment.

TideRL trains it through :mod:`tiderl.env.verifiers_v1` (one episode per task, verifiers' own
harness, interception server and TrainClient)::

    env:
      envs: [calc-v1]
      agents:
        calc-v1: {entry: "tiderl.env.verifiers_v1:run"}
      options:
        calc-v1: {taskset: tiderl.examples.calc_v1}

Run as ``python -m tiderl.examples.calc_v1`` it is the tool server (verifiers starts it that
way).
"""

from __future__ import annotations

try:
    import verifiers.v1 as vf
except ImportError as exc:  # an example: the package's dependencies do not include verifiers
    raise ImportError(f"tiderl.examples.calc_v1 needs verifiers 0.4 (pip install "
                      f"tiderl[verifiers]): {exc}") from exc

from tiderl.examples.calc_common import SYSTEM, problem, run_calculator, score

ROWS = 1000  # problems 0..999 (the row a TideRL task plays: its task number, or its seed)


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def evaluate(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / and parentheses)."""
        return run_calculator({"expression": expression})


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return score(trace.last_reply, self.data.answer) or 0.0


class CalcConfig(vf.TasksetConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self) -> list[CalcTask]:
        tasks = []
        for seed in range(ROWS):
            question, answer = problem(None, seed)
            data = CalcData(idx=seed, name=f"calc-{seed}", system_prompt=SYSTEM,
                            prompt=question, answer=answer)
            tasks.append(CalcTask(data, self.config.task))
        return tasks


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcToolset.run()
