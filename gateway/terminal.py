"""What the CLI and the demo print: answers with their sources, and replay verdicts."""

from rich.console import Console

console = Console()


def print_answer(reply: dict) -> None:
    console.print(reply["choices"][0]["message"]["content"].strip())
    print_sources(reply)


def print_sources(reply: dict) -> None:
    for citation in reply.get("citations", []):
        console.print(
            f"  [{citation['index']}] {citation['title']} ({citation['source_id']} v{citation['version']})",
            style="dim",
        )
    console.print(f"  receipt {reply['receipt_id']}", style="cyan")


def print_replay(result: dict) -> None:
    verified = "[green]verified[/]" if result["context_verified"] else "[red]NOT verified[/]"
    console.print(f"receipt {result['receipt_id']}: context {verified}")
    for problem in result["problems"]:
        console.print(f"  [red]{problem}[/]")
    if result["verdict"] is not None:
        detail = {
            "identical": "bit for bit: a batch-invariant receipt, replayed with the same numerics",
            "tokens_match": "the same tokens; no bitwise claim outside batch-invariant mode",
            "diverged": f"first difference at token {result['first_divergent_token']}",
        }[result["verdict"]]
        console.print(
            f"verdict: [bold]{result['verdict']}[/] ({detail}; token agreement "
            f"{result['token_agreement']:.0%})"
        )
    drift = result["drift"]
    if drift.get("retrieval_enabled"):
        console.print(
            f"drift: snapshot epoch {drift['snapshot_epoch']} -> current epoch {drift['current_epoch']}; retrieval {'unchanged' if drift['retrieval_unchanged'] else 'differs now'}"
        )
        for source in drift["sources"]:
            console.print(f"  {source['source_id']} v{source['cited_version']}: {source['status']}")
            for diff in source.get("chunk_diffs", []):
                console.print(diff["diff"], style="yellow", markup=False, highlight=False)
