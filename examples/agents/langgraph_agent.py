"""The calculator agent of `calculator_agent` written with LangGraph (langgraph and
langchain-openai, the `agents` extra): a `ChatOpenAI` model bound to two tools, in a two-node
`StateGraph` (model -> tools -> model ...) that stops at a reply with no tool call or after
MAX_TURNS model calls; `run` on Chat Completions, `run_responses` on the Responses API. Nothing
here knows turnrl; turnrl trains it unmodified through its gateway (docs/agents.md):

    dvc exp run -S env.name=agent -S '++env.options.program=examples.agents.langgraph_agent:run' \
                -S '++env.options.demonstration=examples.agents.calculator_agent:demonstrate' \
                -S '++env.options.rows=turnrl.data.synthetic:product_rows'

(`rows`: the task rows of `data.train_set: synthetic`, the default; leave it out when
data.train_set and data.heldout_set name files of your own.)

Deployed, the same function runs against any OpenAI-compatible server; only `base_url` and
`api_key` say where the model is:

    run({"prompt": "Compute 347 * 8215.", "answer": "2850605"}, base_url="http://localhost:8000/v1", api_key="...")

The task: multiply two 3-digit numbers (turnrl's synthetic products); reward 1.0 for
<answer>N</answer> with the right product. The demonstration hook is calculator_agent's: the
tools and the answer format are the same, so the same assistant turns drive this program.
"""
from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from examples.agents import calculator_agent

__all__ = ["run", "run_responses"]

MAX_TURNS = 3   # model calls per episode, as in calculator_agent


# the agent's own functions, their schemas from their docstrings
calculator = tool(parse_docstring=True)(calculator_agent.calculator)
count_digits = tool(parse_docstring=True)(calculator_agent.count_digits)


TOOLS = [calculator, count_digits]


def build_graph(model: ChatOpenAI):
    bound = model.bind_tools(TOOLS)

    def call_model(state: MessagesState) -> dict:
        return {"messages": [bound.invoke(state["messages"])]}

    def next_step(state: MessagesState) -> str:
        calls = sum(isinstance(m, AIMessage) for m in state["messages"])
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls and calls < MAX_TURNS else END

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    # a failing tool (a bad expression) answers with the error, as calculator_agent does; the
    # default would raise it out of the graph, ending the episode as an environment error
    graph.add_node("tools", ToolNode(TOOLS, handle_tool_errors=True))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", next_step, ["tools", END])
    graph.add_edge("tools", "model")
    return graph.compile()


def run(task: dict, base_url: str, api_key: str) -> float:
    """One episode of the graph. Returns the reward: 1.0 for the right product, 0.0 otherwise
    (a wrong answer, or still calling tools after MAX_TURNS model calls)."""
    return _episode(task, ChatOpenAI(base_url=base_url, api_key=api_key, model="policy", max_retries=0))


def run_responses(task: dict, base_url: str, api_key: str) -> float:
    """The same episode with the model on the Responses API (`use_responses_api=True`)."""
    return _episode(task, ChatOpenAI(base_url=base_url, api_key=api_key, model="policy", max_retries=0,
                                     use_responses_api=True))


def _episode(task: dict, model: ChatOpenAI) -> float:
    state = build_graph(model).invoke(
        {"messages": [SystemMessage(calculator_agent.SYSTEM), HumanMessage(task["prompt"])]})
    last = state["messages"][-1]
    if not isinstance(last, AIMessage) or last.tool_calls:
        return 0.0
    return calculator_agent.grade(last.text, task["answer"])
