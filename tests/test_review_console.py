"""The review console at /review, driven in Debian's Chromium by Playwright.

One live server (tests/review_support.py) for the module; each test opens a fresh page, drives it
with the keyboard where a reviewer would, and saves a screenshot under its tmp_path. The tests
run in file order: the drift and tamper tests change the corpus and the database last.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest
from review_support import browser, free_port, live_server, serve_live  # noqa: F401  (fixture)
from sqlalchemy import update
from starlette.applications import Starlette
from starlette.routing import Mount
from typer.testing import CliRunner

from engine.timeline import RequestTimeline
from gateway.cli import app as cli
from gateway.routes.review import console_app
from provenance import merkle
from provenance.db import session_scope
from provenance.models import Receipt

pytestmark = pytest.mark.slow

QUESTIONS = [
    "How much does the Plus plan cost?",
    "How long does a password reset link stay valid?",
    "Why does my file not sync?",
    "How do I share a file with a link?",
]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    yield from serve_live(tmp_path_factory)


@pytest.fixture(scope="module")
def answers(live):
    """Four answers asked at once, so decode steps share passes with other prompts' prefill."""
    api, _ = live
    with ThreadPoolExecutor(max_workers=len(QUESTIONS)) as pool:
        replies = list(pool.map(lambda q: api.chat(q, max_tokens=24), QUESTIONS))
    return {q: r["receipt_id"] for q, r in zip(QUESTIONS, replies, strict=True)}


@pytest.fixture
def page(browser, tmp_path, request):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    page.screenshot(path=str(tmp_path / f"{request.node.name}.png"), full_page=True)
    context.close()
    assert not errors, f"the page raised: {errors}"


def sign_in(page, url, key):
    page.goto(f"{url}/review/")
    page.keyboard.type(key)  # the key field has the focus on load
    page.keyboard.press("Enter")
    page.locator("#console").wait_for()


def receipt(api, receipt_id):
    return api.client.get(f"/v1/receipts/{receipt_id}", headers=api.auth()).json()


def open_receipt(page, url, receipt_id):
    page.goto(f"{url}/review/#receipt={receipt_id}")
    page.locator("#detail h2", has_text=receipt_id).wait_for()


def test_receipts_api_filters_pages_and_refuses_bad_input(live, answers):
    api, _ = live

    def listed(**params) -> list[str]:
        response = api.client.get("/v1/receipts", params=params, headers=api.auth())
        assert response.status_code == 200, response.text
        return [r["id"] for r in response.json()["data"]]

    plans = answers["How much does the Plus plan cost?"]
    everything = listed(order="desc")
    assert set(answers.values()) <= set(everything)
    assert listed(source="storage-plans.md") == [plans]
    assert listed(source="storage-plans.md", version=1) == [plans]
    assert listed(source="storage-plans.md", version=2) == []
    assert listed(status="failed") == [] and set(listed(status="ok")) == set(everything)
    assert listed(id=plans) == [plans]
    # A page at a time, newest first, with the cursor each page hands back.
    seen, cursor = [], None
    while True:
        params = {"order": "desc", "limit": 1, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/receipts", params=params, headers=api.auth()).json()
        seen += [r["id"] for r in page["data"]]
        if not (cursor := page["next_cursor"]):
            break
    assert seen == everything
    # Times with an offset mean the same instant as in UTC.
    created = datetime.fromisoformat(receipt(api, plans)["created_at"])
    local = created.astimezone(timezone(timedelta(hours=2))).isoformat()
    assert plans in listed(since=local) and plans not in listed(until=local)
    # The console's own routes answer only the owning tenant's audit keys.
    for method, path in (("GET", f"/v1/receipts/{plans}/context"),
                         ("POST", f"/v1/receipts/{plans}/incident")):
        assert api.client.request(method, path, headers=api.auth("globex")).status_code == 404
        assert api.client.request(method, path, headers=api.auth("acme", "chat")).status_code == 403
    for params, field in (({"version": 1}, "version"), ({"cursor": "nonsense"}, "cursor"),
                          ({"status": "lost"}, "status")):
        response = api.client.get("/v1/receipts", params=params, headers=api.auth())
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_sign_in_explains_a_wrong_key_and_a_missing_scope(page, live):
    api, url = live
    page.goto(f"{url}/review/")
    error = page.locator("#signin-error")
    page.keyboard.type("ink_0000_not-a-key")
    page.keyboard.press("Enter")
    error.filter(has_text="not accepted").wait_for()
    page.fill("#key", api.key("acme", "chat"))
    page.keyboard.press("Enter")
    error.filter(has_text="lacks the audit scope").wait_for()
    assert page.locator("#console").is_hidden()
    page.fill("#key", api.key("acme", "audit"))
    page.keyboard.press("Enter")
    page.locator("#session-label", has_text="audit log of").wait_for()
    # The key lives in this tab's sessionStorage only: a reload stays signed in.
    assert page.evaluate("sessionStorage.getItem('inherent.review.key')") == api.key("acme", "audit")
    assert page.evaluate("localStorage.length") == 0
    page.reload()
    page.locator("#console").wait_for()


def test_search_by_source_with_the_keyboard_and_open_a_receipt(page, live, answers):
    api, url = live
    # Hold back the unfiltered search the console runs on sign-in until the reviewer's own search
    # has answered: its late page must not land among the filtered results.
    held = []
    page.route(lambda u: "/v1/receipts?" in u and "source=" not in u,
               lambda route: held.append(route) if not held else route.continue_())
    sign_in(page, url, api.key("acme", "audit"))
    page.locator("#f-source").wait_for()
    assert page.evaluate("document.activeElement.id") == "f-source"
    page.keyboard.type("storage-plans.md")
    page.keyboard.press("Enter")
    page.locator("#results-summary", has_text="1 answer").wait_for()
    assert len(held) == 1
    with page.expect_response(lambda r: r.request == held[0].request):
        held[0].continue_()
    page.wait_for_timeout(300)  # the stale page's JSON is parsed and dropped in a few ms
    plans = answers["How much does the Plus plan cost?"]
    assert page.locator("#results-summary").inner_text() == "1 answer"
    assert page.locator(".result").evaluate_all("els => els.map(e => e.dataset.receipt)") == [plans]
    # Keyboard only: Tab from the form reaches the result; Enter opens it.
    for _ in range(40):  # the date fields take a stop per part
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.classList.contains('result')"):
            break
    page.keyboard.press("Enter")
    page.locator("#detail h2", has_text=plans).wait_for()

    body = receipt(api, plans)["body"]
    cited = body["inherent.retrieval.chunks"]
    assert page.locator(".question").inner_text() == "How much does the Plus plan cost?"
    table = page.locator("table.citations").inner_text()
    for chunk in cited:
        assert chunk["source_id"] in table and f"v{chunk['version']}" in table
        assert page.locator(f"code[title='{chunk['chunk_hash']}']").count() == 1
    # The exact prompt, rebuilt and verified, with each retrieved chunk marked.
    page.locator("#prompt-status", has_text="verified").wait_for()
    marks = page.locator("#prompt-text mark.chunk")
    assert marks.evaluate_all("els => els.map(e => e.dataset.chunk)") == [
        c["chunk_id"] for c in cited
    ]
    model = page.locator("#model").inner_text()
    assert body["gen_ai.request.model"] in model
    assert page.locator(f"#model code[title='{body['inherent.model.weights_hash']}']").count() == 1
    assert "batch_invariant" in model and "temperature" in model


def test_timeline_svg_has_one_mark_per_recorded_phase_and_chunk(page, live, answers):
    api, url = live
    timelines = {rid: receipt(api, rid)["body"]["inherent.timeline"] for rid in answers.values()}
    # Concurrent prompts: at least one answer decoded while another prompt's prefill ran.
    rid = max(timelines, key=lambda r: timelines[r]["interference_steps"])
    timeline = timelines[rid]
    assert timeline["interference_steps"] >= 1 and len(timeline["prefill_chunks"]) >= 2
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, rid)
    svg = page.locator("#timeline svg.timeline")
    count = lambda kind: svg.locator(f"[data-mark='{kind}']").count()  # noqa: E731
    assert count("queue") == 1
    assert count("prefill-chunk") == len(timeline["prefill_chunks"])
    assert count("decode") == 1
    assert count("interference") == timeline["interference_steps"]
    assert count("kv-transfer") == 0  # colocated: no hand-off to draw
    assert svg.locator("[data-mark]").count() == 2 + len(timeline["prefill_chunks"]) + timeline[
        "interference_steps"
    ]
    stats = page.locator("#timeline .stats").inner_text()
    assert "TTFT" in stats and "TPOT" in stats
    assert "Latency owned by" in page.locator("#diagnosis").inner_text()


@pytest.fixture(scope="module")
def console_only():
    """Only the console's files, no model: for tests of its modules in the browser."""
    with live_server(Starlette(routes=[Mount("/review", app=console_app())]), free_port()) as url:
        yield url


def test_timeline_marks_the_kv_transfer_of_a_disaggregated_request(page, console_only):
    """The engine's own summary of a disaggregated request, drawn by the page's module."""
    url = console_only
    t = RequestTimeline(arrival=0.0)
    for step, (start, end) in enumerate([(0.01, 0.05), (0.05, 0.09), (0.09, 0.12)]):
        t.record_prefill_chunk(step, 64, start, end)
    t.record_kv_transfer(0.12, 0.15, 3 << 20)
    for at, hit in [(0.16, True), (0.17, False), (0.19, True), (0.20, False)]:
        t.record_token(at, hit)
    t.finished = 0.2
    summary = t.summary().to_dict()  # the JSON a receipt stores
    page.goto(f"{url}/review/")
    kinds = page.evaluate(
        """async (summary) => {
            const { timelineSvg } = await import("./timeline.js");
            const svg = timelineSvg(summary);
            return [...svg.querySelectorAll("[data-mark]")].map((e) => e.dataset.mark);
        }""",
        summary,
    )
    assert sorted(kinds) == sorted(
        ["queue", "prefill-chunk", "prefill-chunk", "prefill-chunk", "kv-transfer", "decode",
         "interference"]
    )  # the first token's flag means nothing: one interfered step, the gap before 0.19 s


def test_browser_merkle_walk_matches_the_server(page, console_only):
    """verify.js against provenance/merkle.py: every leaf of trees of 1 to 17 leaves."""
    url = console_only
    cases = []
    for size in range(1, 18):
        leaves = [merkle.leaf_hash(f"leaf {i} of {size}".encode()) for i in range(size)]
        root = merkle.root(leaves).hex()
        for index in range(size):
            path = [h.hex() for h in merkle.inclusion_proof(index, leaves)]
            cases.append({"data": f"leaf {index} of {size}", "index": index, "size": size,
                          "path": path, "root": root})
    page.goto(f"{url}/review/")
    results = page.evaluate(
        """async (cases) => {
            const { hex, leafHash, rootFromPath } = await import("./verify.js");
            const bytes = (s) => new TextEncoder().encode(s);
            const unhex = (h) => Uint8Array.from(h.match(/../g) || [], (p) => parseInt(p, 16));
            return cases.map((c) => {
                const leaf = leafHash(bytes(c.data));
                const root = rootFromPath(c.index, c.size, leaf, c.path.map(unhex));
                const other = rootFromPath(c.index, c.size, leafHash(bytes(c.data + "!")), c.path.map(unhex));
                return [root && hex(root) === c.root, !other || hex(other) !== c.root];
            });
        }""",
        cases,
    )
    assert len(results) == sum(range(1, 18))
    assert all(ok and tamper_caught for ok, tamper_caught in results)


def test_replay_reads_identical(page, live, answers):
    api, url = live
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, answers["How long does a password reset link stay valid?"])
    page.locator("#replay").focus()
    page.keyboard.press("Enter")
    verdict = page.locator("#replay-verdict .verdict-word")
    verdict.wait_for()
    assert verdict.inner_text() == "identical"
    texts = page.locator("#replay-texts .answer").all_inner_texts()
    assert texts[0] == texts[1] and page.locator("#replay-texts mark.divergent").count() == 0


def test_inclusion_check_passes_in_the_browser(page, live, answers):
    api, url = live
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, answers["Why does my file not sync?"])
    page.click("#check")
    verdict = page.locator("#check-verdict")
    verdict.wait_for()
    assert verdict.inner_text().startswith("✓ Included")
    assert page.locator(".steps li.failed").count() == 0
    root = api.client.get("/v1/audit/root", headers=api.auth()).json()["root"]
    assert root[:16] in page.locator(".steps").inner_text()


def test_bundle_verifies_offline_and_fails_when_one_byte_changes(page, live, answers, tmp_path):
    api, url = live
    rid = answers["How do I share a file with a link?"]
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, rid)
    page.click("#replay")
    page.locator("#replay-verdict").wait_for()
    with page.expect_download() as download:
        page.click("#export")
    bundle = tmp_path / "incident.json"
    download.value.save_as(bundle)
    assert json.loads(bundle.read_bytes())["receipt"]["id"] == rid

    runner = CliRunner()
    ok = runner.invoke(cli, ["audit", "verify-bundle", str(bundle)])
    assert ok.exit_code == 0, ok.output
    assert f"receipt {rid}" in ok.stdout and "identical" in ok.stdout

    raw = bytearray(bundle.read_bytes())
    at = raw.index(b'"inherent.output.text":"') + len(b'"inherent.output.text":"')
    raw[at] = ord("X") if raw[at] != ord("X") else ord("Y")
    tampered = tmp_path / "tampered.json"
    tampered.write_bytes(bytes(raw))
    bad = runner.invoke(cli, ["audit", "verify-bundle", str(tampered)])
    assert bad.exit_code == 1
    assert "checksum mismatch" in bad.stderr
    assert "does not hash to the body hash" in bad.stderr


def test_clear_messages_for_an_unknown_receipt_and_a_server_that_is_down(page, live):
    api, url = live
    sign_in(page, url, api.key("acme", "audit"))
    page.goto(f"{url}/review/#receipt=rcpt_doesnotexist")
    page.reload()
    page.locator(".error-box", has_text="No such receipt").wait_for()
    page.route("**/v1/**", lambda route: route.abort("connectionrefused"))
    page.click("#search-form button[type=submit]")
    page.locator("#notice", has_text="cannot be reached").wait_for()


def test_narrow_window_keeps_everything_on_screen(browser, live, answers, tmp_path):
    api, url = live
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, answers["How much does the Plus plan cost?"])
    page.locator("#prompt-status", has_text="verified").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.screenshot(path=str(tmp_path / "narrow.png"), full_page=True)
    context.close()


def test_drift_diff_shows_the_changed_line(page, live, answers):
    api, url = live
    plans = api.corpus / "storage-plans.md"
    plans.write_text(
        plans.read_text().replace("costs 4 euros per month", "costs 5 euros per month")
    )
    api.ingest("acme", api.corpus)
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, answers["How much does the Plus plan cost?"])
    page.click("#replay")
    source = page.locator("#drift li[data-source='storage-plans.md']")
    source.wait_for()
    assert source.get_attribute("data-status") == "changed"
    assert source.locator("td.removed", has_text="costs 4 euros per month").count() == 1
    assert source.locator("td.added", has_text="costs 5 euros per month").count() == 1
    assert "storage-plans.md v2" in page.locator("#drift .now").inner_text()


def test_inclusion_check_fails_after_the_receipt_row_is_edited(page, live, answers):
    api, url = live
    rid = answers["Why does my file not sync?"]
    with session_scope(api.settings.sqlalchemy_url, write=True) as session:
        row = session.get(Receipt, rid)
        body = {**row.body, "inherent.output.text": "Restart the sync client."}
        session.execute(update(Receipt).where(Receipt.id == rid).values(body=body))
    sign_in(page, url, api.key("acme", "audit"))
    open_receipt(page, url, rid)
    assert page.locator(".answer").first.inner_text() == "Restart the sync client."
    page.click("#check")
    verdict = page.locator("#check-verdict")
    verdict.wait_for()
    assert verdict.inner_text().startswith("✗ Check failed")
    failed = page.locator(".steps li.failed").all_inner_texts()
    assert any("The leaf hash is the one logged" in f and "edited" in f for f in failed)
    assert any("leads to the current root" in f for f in failed)
