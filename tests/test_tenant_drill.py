"""Tenants under load and kill -9 (issue 43): four tenants with mixed consent, storage and
personal-data policies hold multi-turn sessions through the gateway, some messages carrying an
e-mail address, a card number or a phone number; the gateway and then the collector are killed
mid-way and restarted. Nothing of the tenant with `store: false`, nothing of a message whose
personal data `pii: drop` keeps out and no raw value that `pii: redact_input` replaces reaches
any stream, the object store, a spill file or any file of the run directory (token ids
included); no sample without consent is trained; every session of the others that may be kept
is one complete trajectory and sample, trained once if it has consent (flywheel/drills/tenant_drill.py;
bench/tenant_drill.py runs it at size)."""

from flywheel.drills.tenant_audit import allowed, found_in, needles
from flywheel.drills.tenant_drill import failures, tenant_drill
from flywheel.drills.tenant_load import (
    CYCLE,
    KINDS,
    TenantLoad,
    luhn_digit,
    pii_value,
    plan,
)


def test_the_drills_personal_data_is_what_the_detector_finds_and_the_audit_looks_for():
    from flywheel.privacy import find

    load = TenantLoad(tag="0a1b2c")
    for i in range(CYCLE):
        session = load.sessions[f"s{i}"] = plan(load.tag, i)
        if session.pii_type:
            sentence, session.pii = pii_value(session.pii_type, load.tag, i)
            assert [f.type for f in find(sentence)] == [session.pii_type], sentence
            assert found_in(sentence.encode()) == {session.pii}
        assert not find(f"Count from {i}. {session.marker}")  # markers are not personal data
    card = pii_value("CREDIT_CARD", load.tag, 7)[1].replace(" ", "")
    assert luhn_digit(card[:-1]) == card[-1]
    index = needles(load)
    assert len(index) == sum(1 + 2 * bool(s.pii) + (s.pii_type == "CREDIT_CARD") for s in load.sessions.values())
    kinds = {k.name: k for k in KINDS}
    assert not allowed(kinds["silent-plain"], "marker") and not allowed(kinds["careful-pii"], "marker")
    assert allowed(kinds["careful-pii-last"], "marker") and not allowed(kinds["careful-pii-last"], "pii_marker")
    assert allowed(kinds["redacting-pii"], "pii_marker") and not allowed(kinds["redacting-pii"], "pii")
    assert allowed(kinds["open-pii"], "pii")
    assert sum(k.trainable for k in KINDS) * 4 % 8 == 0  # a cycle's trainable sessions fill whole batches


async def test_four_tenants_under_kill_9_of_gateway_and_collector_leak_nothing_and_lose_nothing(tmp_path):
    report = await tenant_drill(tmp_path, min_sessions=CYCLE)
    assert [k["victim"] for k in report["kills"]] == ["serve", "collect"], report["kills"]
    assert 0 < report["kills"][0]["sessions_ended"] < report["kills"][1]["sessions_ended"] < report["sessions"], report["kills"]
    assert failures(report) == {}, (failures(report), report["leak_examples"], report["failed_examples"])
    assert report["sessions_answered"] == report["sessions"] >= CYCLE
    tenants = report["tenants"]
    # nothing of silent anywhere; every kept session of the others there, trained as its consent says
    assert tenants["silent"]["turns_on_bus"] == tenants["silent"]["events_on_bus"] == tenants["silent"]["sessions_registered"] == 0
    for name, row in tenants.items():
        assert row["trajectories_on_bus"] == row["samples_on_bus"] == row["expected_trajectories"], (name, row)
        assert row.get("trained", 0) == row["expected_trained"], (name, row)
        assert row["trajectories_on_bus_with_consent"] == row["expected_trained"], (name, row)
    assert tenants["careful"]["refused_by_trainer"] >= tenants["careful"]["expected_trajectories"] - tenants["careful"]["expected_trained"]
    # the control: open-co's personal data (pii off) is seen by every scan that must be able to see it
    for where in ("stream:TRAFFIC", "stream:TRAJECTORIES", "disk:nats-store", "tokens"):
        seen, sent = report["control"][where].split("/")
        assert seen == sent != "0", (where, report["control"])
    assert report["kinds"]["redacting-pii"]["redacted"] > 0
