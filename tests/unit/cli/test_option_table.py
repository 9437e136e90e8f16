"""The fast path's option table (ui/optiontable.py) is the parser's, and what the agent
answers are options the parser has."""

from __future__ import annotations

from reconciler.cli.entry import ANSWERED
from reconciler.ui import optiontable
from reconciler.ui.parser import option_table


def test_the_generated_table_is_the_parsers() -> None:
    tables = option_table()
    stale = "reconciler/ui/optiontable.py is stale: run python3 scripts/gen-option-table.py"
    assert tables["global"] == optiontable.GLOBAL, stale
    assert tables["plan"] == optiontable.PLAN, stale


def test_every_global_option_is_a_plan_option_too() -> None:
    assert optiontable.GLOBAL.items() <= optiontable.PLAN.items()


def test_what_the_agent_answers_is_an_option_of_plan() -> None:
    dests = {dest for dest, _how in optiontable.PLAN.values()}
    assert dests >= ANSWERED, sorted(ANSWERED - dests)
