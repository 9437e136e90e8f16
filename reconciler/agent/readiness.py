"""Whether this host may count as done in a fleet rollout: the verdict behind ``/readyz``.

Liveness (``/healthz``) says the loop runs; readiness says the host is *good* at the
revision it was given, so that the engine rolling a new revision out (a DaemonSet
with ``maxUnavailable``, a Nomad system job with ``max_parallel``) takes the next host
only after this one converged, and stops at the first host where it did not (SPEC
§10). Ready means all of: the files at the current revision loaded (and are the
revision ``--expect-revision`` names), the last pass that finished ran at that
revision and converged and verified, the probes ran at that revision and every one
holds, no change waits for confirmation and the revision is not one this host
reverted. The loop shows a new revision as soon as a pass at it starts, while the
last pass and the probes that finished are still the old revision's: each records
the revision it ran at, and only records of the current one count (else a rollout
would take the next host while this one is still applying, or about to fail).
Anything else is not ready, with one line that says why — the line an operator reads
in ``kubectl describe pod`` or ``nomad alloc status``.

The verdict is a pure function of the status document (what ``reconcile status``
shows) and two facts the document does not hold: whether the agent probes at all and
whether its loop is alive, so a test can pin every reason without an agent.

The seam with safe change (SPEC §8): ``pending`` and ``reverted_revision`` are keys
that branch writes into the status document (absent = null until then). Their
reasons are pinned on hand-made documents in tests/unit/agent/test_readiness.py; once the
agent writes them, a test must reach them through the agent's real document, as
``test_status_shape`` does for every other key (its ``SEAM`` set goes away then).

See docs/decisions/030-fleet-readiness.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reconciler.agent.revision import describe_revision

#: results of a pass that count as converged (``drift``: --dry-run found differences)
CONVERGED = ("ok", "applied")


@dataclass(frozen=True)
class Verdict:
    ready: bool
    reason: str  # one line

    def to_json(self) -> dict[str, Any]:
        return {"ready": self.ready, "reason": self.reason}


def _first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0] if lines else ""


def same_revision(rev: dict[str, Any] | None, name: str | None) -> bool:
    """Tell whether ``name`` (a commit id, a prefix of one of 7+ characters, the short form the
    logs show, or the files' digest) names the revision ``rev``."""
    if not rev or not name:
        return False
    name = name.strip().lower()
    if name == describe_revision(rev).lower():
        return True
    commit = str(rev.get("commit") or "").lower()
    if commit:
        return name == commit or (len(name) >= 7 and commit.startswith(name))
    digest = str(rev.get("files_sha256") or "").lower()
    return bool(digest) and name in (digest, f"sha256:{digest}")


#: what names a desired state: the other keys of a revision (its commit time, the
#: checkout's directory) follow from these
_IDENTITY = ("commit", "dirty", "files_sha256")


def same_state(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Tell whether two revision records (``revision``, ``last_pass.revision``,
    ``probes.revision``) are the same files: the same commit, dirty flag and digest of the
    files' names and contents (a local edit of a commit is another state)."""
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in _IDENTITY)


def _describe(rev: dict[str, Any] | None) -> str:
    return describe_revision(rev) if rev else "?"


def judge(doc: dict[str, Any], *, probing: bool, alive: tuple[bool, str] = (True, "ok")
          ) -> Verdict:
    """Return the readiness of the agent whose status document is ``doc``.

    ``probing``: the agent probes (so probes must have run and hold); ``alive``: what
    ``/healthz`` says (a stuck loop is not ready either). The checks run in the order an
    operator would fix things: the agent itself, the files, a change in flight, then
    what the last pass and the probes found.
    """
    state = doc.get("state")
    if state in ("stopping", "stopped"):
        return Verdict(False, "the agent is stopping")
    ok, why = alive
    if not ok:
        return Verdict(False, f"the agent is not alive: {why}")
    rev = doc.get("revision")
    cfg = doc.get("config_error")
    if cfg:
        at = describe_revision(cfg.get("revision") or {}) if cfg.get("revision") else "?"
        return Verdict(False, f"desired state at {at} not taken: "
                              f"{_first_line(cfg.get('message')) or 'invalid'}")
    pending = doc.get("pending")
    if pending:
        return Verdict(False, "a change waits for confirmation (it is reverted unless "
                              f"confirmed by {pending.get('deadline') or '?'})")
    reverted = doc.get("reverted_revision")
    if reverted and same_revision(rev, str(reverted)):
        return Verdict(False, f"revision {describe_revision(rev or {})} was reverted on this "
                              "host; roll out another revision")
    last = doc.get("last_pass")
    if state == "starting" or not last:
        return Verdict(False, "no pass has finished yet")
    n, result = last.get("number"), last.get("result")
    if not same_state(last.get("revision"), rev):
        # the pass at the current revision started (the loop showed its revision) and has
        # not finished: what finished converged another revision
        return Verdict(False, f"the pass at {_describe(rev)} has not finished yet "
                              f"(pass #{n} was at {_describe(last.get('revision'))})")
    errors = doc.get("errors") or []
    if result == "drift":
        return Verdict(False, f"pass #{n} found {len(errors)} difference(s) and --dry-run "
                              "changes nothing")
    stuck = doc.get("blocked") or []
    if stuck:  # everything else converged; these cannot (SPEC §11)
        listed = "; ".join(f"{b.get('resource')}: {_first_line(b.get('reason'))}"
                           for b in stuck[:3])
        more = f"; and {len(stuck) - 3} more" if len(stuck) > 3 else ""
        return Verdict(False, f"pass #{n}: {len(stuck)} resource(s) blocked: {listed}{more}")
    if result not in CONVERGED:
        # the first resource's own error says what (a conflict names both sides); the
        # pass's summary line only counts them
        detail = (f"{errors[0].get('resource')}: {_first_line(errors[0].get('error'))}"
                  if errors else _first_line(last.get("error")))
        return Verdict(False, f"pass #{n} {result}" + (f": {detail}" if detail else ""))
    if errors:
        e = errors[0]
        return Verdict(False, f"pass #{n}: {e.get('resource')}: {_first_line(e.get('error'))}")
    probes: dict[str, Any] = doc.get("probes") or {}
    if not same_state(probes.get("revision"), rev):
        probes = {}  # an older revision's probes say nothing about this one
    allocs = (doc.get("desired") or {}).get("allocs", 0)
    if probing and allocs and not probes:
        return Verdict(False, f"pass #{n} converged; its probes have not run yet")
    if probes.get("failed"):
        f = (probes.get("failures") or [{}])[0]
        return Verdict(False, f"{probes['failed']} probe(s) failing: alloc {f.get('alloc')} "
                              f"path {f.get('path')}: {f.get('cause') or 'no cause found'}")
    held = f", {probes['held']} probe(s) hold" if probes.get("held") else ""
    return Verdict(True, f"ready: {_describe(rev)} converged in pass #{n}{held}")
