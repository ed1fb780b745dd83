"""`mlcrun compile MODEL -o OUT` and `mlcrun compile --list-quantizations`."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import (
    REVISION,
    RichProgress,
    err_console,
    handle_errors,
    local_model,
    setup_logging,
)


@handle_errors
def compile_command(
    model: str = typer.Argument(
        None,
        help="HF checkpoint folder, a .gguf file, or a Hugging Face Hub id (owner/name, or "
        "owner/name/FILE.gguf; downloaded unless cached).",
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Artifact folder to write."),
    quantization: str = typer.Option(
        "auto",
        "--quantization",
        "-q",
        help="Weight format (see --list-quantizations); auto keeps the checkpoint's own.",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    activations: str = typer.Option(
        "auto",
        "--activations",
        help="Quantized matmuls: int8 (q4/q8: activations quantized per 32, integer dot "
        "products with VNNI or AVX2), bf16 (q0bf16: activations rounded to bf16, AVX512-BF16 "
        "vdpbf16ps), exact (float32 activations, results exact in fp32), or auto (int8 / bf16 "
        "where the CPU has AVX2 / AVX512-BF16).",
    ),
    kv_dtype: str = typer.Option(
        "float32",
        "--kv-dtype",
        help="KV-cache dtype: float32, or float16 (half the KV memory; attention still "
        "computes in float32).",
    ),
    context_window: int = typer.Option(
        None,
        "--context-window",
        help="Max tokens per sequence (default: the model's, at most 8192).",
    ),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="Max tokens per prefill call."),
    max_batch: int = typer.Option(16, "--max-batch", help="Max sequences decoded together."),
    page_size: int = typer.Option(
        16, "--page-size", help="Tokens per KV-cache page (cpu: 16 only)."
    ),
    draft_quantization: str = typer.Option(
        None,
        "--draft-quantization",
        help="Also write OUT/draft-Q/: the model's own weights in Q (e.g. q4f16_1+q8f16), a "
        "draft for self-speculative decoding of q0f32, q0f16, q0bf16 and q8 models.",
    ),
    revision: str = REVISION,
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite OUT if it exists."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log each phase."),
    list_quantizations: bool = typer.Option(
        False, "--list-quantizations", help="Print the quantization presets and exit."
    ),
) -> None:
    """Compile a checkpoint into an artifact folder: params, tokenizer and a TVM library."""
    setup_logging(verbose)
    if list_quantizations:
        from ..quant import PRESETS

        for p in PRESETS.values():
            typer.echo(f"{p.name:<8} {p.bits_per_weight:5.2f} bits/weight  {p.description}")
        typer.echo(
            f"{'auto':<8} {'':5} {'':11}  the preset that stores the checkpoint's weights "
            "exactly (GGUF Q4_0 -> q4f16_0, Q4_1 -> q4f16_1, Q8_0 -> q8f16, F16 -> q0f16, BF16 -> "
            "q0bf16; default)"
        )
        return
    if model is None or output is None:
        err_console.print("error: MODEL and --output/-o are required", highlight=False)
        raise typer.Exit(2)  # a usage error, as click reports a missing argument
    from ..compiler.build import compile_model, is_up_to_date
    from ..compiler.options import CompileOptions

    model = local_model(model, revision)

    options = CompileOptions(
        quantization=quantization,
        device=device,
        context_window=context_window,
        prefill_chunk=prefill_chunk,
        max_batch=max_batch,
        page_size=page_size,
        activations=activations,
        kv_dtype=kv_dtype,
    )
    if draft_quantization is not None:
        from ..compiler import draft

        draft.draft_preset(draft_quantization)  # an unknown preset fails before the compile
        if quantization != "auto":
            draft.check_helps(quantization, draft_quantization)
    model_done = not force and is_up_to_date(model, output, options)
    if model_done and (
        draft_quantization is None or draft.draft_is_up_to_date(output, draft_quantization)
    ):
        err_console.print(f"{output} is up to date (use --force to rebuild)", highlight=False)
        return
    with RichProgress() as progress:
        if not model_done:
            out = compile_model(model, output, options, force=force, progress=progress)
            err_console.print(f"[green]compiled[/] {model} -> {out}", highlight=False)
        if draft_quantization is not None:
            # After the model, atomically on its own: a failed draft leaves OUT complete
            # without it, and the same command again builds only the draft.
            path = draft.compile_draft(output, draft_quantization, progress=progress)
            err_console.print(f"[green]draft[/] {draft_quantization} -> {path}", highlight=False)
