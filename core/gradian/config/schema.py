"""Dataclass schemas for every config section, with help text and validation.

Field names and defaults follow the documented configuration reference. Each field carries its
help text in ``metadata["help"]``; ``init-config`` writes those as comments. Validation lives in
``validate_config`` so a bad value is reported with its full dotted key (``grads.batch_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, TypeVar

from gradian.config.audit import AuditConfig
from gradian.config.engines import BUILTIN_ENGINES
from gradian.config.verdict import VerdictConfig

__all__ = [
    "GradsConfig",
    "EngineConfig",
    "EvaluationConfig",
    "ClusteringConfig",
    "TrainConfig",
    "GradianConfig",
    "CHOICES",
]


_T = TypeVar("_T")


def _f(default: _T, help: str) -> _T:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class GradsConfig:
    strategy: str = _f("hooks", "Per-example gradient capture: hooks (exact, default), loop (batch-1 reference), vmap (opt-in)")
    loss_reduction: str = _f("mean", "Per-example loss over supervised tokens: mean or sum")
    normalization: str = _f("none", "Gradient normalization before scoring: none, l2 or token_count")
    batch_size: int = _f(4, "Examples per gradient batch; the main memory lever")
    max_seq_length: int = _f(1024, "Truncation length while indexing; the second memory lever")
    module_filter: Optional[str] = _f(None, "Regex on the full module name (e.g. 'mlp.down_proj' or 'layers\\.1[0-5]\\.'); null keeps every LoRA module")
    block_granularity: str = _f("module", "A block is a whole LoRA module (module) or each of A and B (matrix)")
    projection_dim: Optional[int] = _f(None, "Random projection width per block; null stores full gradients")
    projection_kind: str = _f("countsketch", "Projection family: countsketch or rademacher (the flattened block), or kronecker (each LoRA matrix's input and output sides projected apart, so ekfac and kfac still fit their curvature on the projected index)")
    projection_seed: int = _f(0, "Seed of the projection; part of the index id")
    storage_dtype: str = _f("float32", "float32 or float16 (halves the index on disk)")
    chunk_size: int = _f(256, "Examples per chunk of the memory-mapped store")
    max_index_gb: Optional[float] = _f(100.0, "Largest full-width index in GiB. Under engine.store auto a bigger one is not written: the gradients are streamed instead. Under engine.store index a random projection is turned on (announced, recorded in the manifest), or, under ekfac/kfac, the run stops naming the ways out; null sets no limit")


@dataclass
class EngineConfig:
    name: str = _f("ekfac", "Attribution engine: " + "; ".join(f"{e.name}, {e.summary}" for e in BUILTIN_ENGINES)
                   + "; or an engine a package registers under the gradian.engines entry points")
    lambda_scale: float = _f(0.1, "Damping as a multiple of the mean curvature eigenvalue: per block, the mean squared gradient norm over the block width (datainf); per LoRA matrix (ekfac, kfac)")
    lambda_override: Optional[float] = _f(None, "Absolute damping for every block or matrix; overrides lambda_scale")
    normalize_query: bool = _f(False, "Scale the query gradient to unit norm (curvature-free engines only)")
    fisher: str = _f("empirical", "Curvature of ekfac/kfac: empirical (training labels, deterministic) or sampled (labels sampled from the model; `true` is accepted too)")
    fisher_samples: int = _f(1, "Label draws averaged by the sampled Fisher")
    fisher_seed: int = _f(0, "Seed of the sampled Fisher's label draws; part of the fitted state's id")
    factor_rows: Optional[int] = _f(None, "Rows the Kronecker factors of ekfac/kfac are summed over: null for every row, or about this many, each row chosen by a hash of its tokens (the same rows in every pass, store and shard); ekfac's eigenvalue correction still reads every row. With engine.store: stream the first pass then runs over those rows only")
    correction_rows: Optional[int] = _f(None, "Rows ekfac's eigenvalue correction averages over: null for every row, or about this many, chosen by the same hash of their tokens as engine.factor_rows (at equal counts the same rows; a smaller count picks a subset of a larger one's). With engine.store: stream the correction pass then runs over those rows only, unless it also keeps the squared norms a DataInf cross-check reads. kfac makes no correction and refuses it")
    checkpoints: str = _f("final", "Adapters ekfac/kfac are fitted and scored under: final (the trained adapter) or all (every saved checkpoint-N, summed with the learning rate at each, as TracIn does; falls back to final when the run saved none)")
    store: str = _f("auto", "Where the training gradients come from: index (written to the on-disk index once, read by every pass), stream (recomputed from the model in each pass, nothing written; the same numbers the index would hold), or auto (the index when it fits grads.max_index_gb and the free disk of cache_dir, the stream otherwise; the run says which)")
    replay_horizon: Optional[int] = _f(None, "Optimizer steps, counted from the end of the run, through which the replay engine differentiates each row's weight; null: the last epoch (every row once)")
    replay_start: str = _f("auto", "Where the replay engine starts: auto (from the run's latest trainer checkpoint, kept with its optimizer state, at or before the first differentiated step, so only the steps after it are retrained; the first step when there is none) or beginning (always retrains every step from the run's initialization)")
    replay_scaling: str = _f("exact", "How the replay engine's derivative treats the step sizes: exact (a row's weight also acts through AdamW's second moments and the clipping factor, which it changes) or held (those are held at the run's values, so a weight acts through its gradient and the trajectory after it only); the replayed run is the same either way")
    replay_checkpoint_every: Optional[int] = _f(None, "Optimizer steps between the states the replay engine writes under cache_dir/replay; a segment's states are held in memory while it is swept back, so a smaller value holds fewer (and writes more); null: the root of the run's steps")
    normalize_train: str = _f("relatif", "How ekfac/kfac order the rows: relatif (each row's influence divided by the square root of its self-influence, so rows with large gradients do not crowd the top) or none (raw influence); the scores, cluster harm and loss figures stay influence in loss units either way")
    rank_items: str = _f("harm", "How rows are ordered when the query holds several eval items: harm (by the harm a row does, summed over the items it hurts; what it does for the other items is left aside, so a row that teaches one entity another entity's answer ranks as harmful) or mean (by its mean value over the items, so its help to one item offsets its harm to another)")
    options: Dict[str, Dict[str, Any]] = _f({}, "One engine's own settings, by engine name (engine.options.<name>.<key>): the keys its options class declares, checked when it runs; for what only that engine reads, such as a plugin engine's settings")


@dataclass
class EvaluationConfig:
    max_new_tokens: int = _f(32, "Generation cap when measuring the capability")
    batch_size: int = _f(8, "Generation batch size")
    n_bootstrap: int = _f(2000, "Paired bootstrap resamples for the confidence interval")
    ci_level: float = _f(0.95, "Confidence level of the significance gate")
    metric: str = _f("exact_match", "exact_match, contains, not_contains or loglik (a proxy)")
    greedy: bool = _f(True, "Greedy decoding, for reproducible measurements")
    require_significant: bool = _f(True, "Refuse to attribute when the delta's interval includes zero")
    min_items: int = _f(5, "Fewest eval items the significance gate accepts; with fewer it does not pass, whatever the interval")
    query_signal: str = _f("auto", "Query gradient: contrastive, target, or auto (contrastive when generations exist)")
    query_scope: str = _f("lost", "Eval items the query is built from: lost (the items the tuned model now fails, and the ones it still passes whose wanted answer lost at least evaluation.query_lost_nats of log-likelihood: all of them order the rows, the failed ones alone make the score column and the accused set) or flipped (only the items it now fails)")
    query_lost_nats: float = _f(0.1, "Under query_scope lost: how much log-likelihood (nats, summed over the answer's tokens) an item still answered right must have lost to join the query")
    query_kept_contrast: str = _f("runner_up", "Under query_scope lost and a contrastive query, what an item still answered right subtracts: runner_up (the answer the tuned model gives when it does not give the wanted one) or none (nothing: its wanted answer's gradient alone)")


@dataclass
class ClusteringConfig:
    method: str = _f("auto", "auto, hdbscan, kmeans, declared (rows' cluster/cluster_id) or none")
    space: str = _f("text", "What the clusters are formed over: text (sentence embeddings), gradient (per-example gradients from the index), both, or auto (text and gradient, keeping the lumpier)")
    n_clusters: int = _f(8, "Cluster count for kmeans")
    min_cluster_size: int = _f(5, "Smallest cluster HDBSCAN may form")
    embed_model: str = _f("sentence-transformers/all-MiniLM-L6-v2", "Sentence embedding model (the packaged offline copy is used for this name)")
    embed_backend: str = _f("auto", "auto, sentence-transformers or tfidf")
    max_features: int = _f(4096, "TF-IDF vocabulary cap")
    svd_dim: int = _f(64, "SVD width in the TF-IDF path")
    top_examples_per_cluster: int = _f(5, "Example excerpts shown per cluster")
    label_top_terms: int = _f(4, "Terms in a cluster's label")
    explain_top_accused: int = _f(3, "Top rows of the accused set whose harmful span the report shows (0: none)")
    accused_sibling_cosine: float = _f(0.5, "Rows whose full gradient has at least this cosine with an accused row's join the accused set (0: none)")
    accused_sibling_anchor: float = _f(0.25, "Only accused rows the score mixture holds harmful with at least this probability bring siblings (0: every accused row)")
    accused_known_nats: float = _f(0.1, "Accused rows whose supervised tokens cost the base model at most this many nats in all (it already gave them with probability >= exp(-x)) are left out: the fine-tune taught them nothing (0: keep them)")


@dataclass
class TrainConfig:
    backend: str = _f("hf", "Training backend: hf (transformers' Trainer), trl (TRL's SFTTrainer, pip install 'gradian-mlflow[train]') or unsloth")
    base_model: str = _f("", "Base model to fine-tune; empty uses the top-level base_model")
    output_dir: str = _f("runs/run", "Where the run (adapter, logs, gradian_run.json) is written")
    r: int = _f(8, "LoRA rank")
    lora_alpha: int = _f(16, "LoRA alpha; the update is scaled by alpha / r")
    lora_dropout: float = _f(0.0, "LoRA dropout during training (always off during attribution)")
    target_modules: Optional[List[str]] = _f(None, "Modules to adapt; null lets peft pick its default for the architecture")
    learning_rate: float = _f(0.0002, "Peak learning rate")
    num_train_epochs: float = _f(1.0, "Epochs over the dataset")
    per_device_train_batch_size: int = _f(2, "Batch size per device")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step")
    warmup_ratio: float = _f(0.03, "Share of steps spent warming up the learning rate")
    lr_scheduler_type: str = _f("linear", "Learning-rate schedule (any transformers scheduler name)")
    max_seq_length: int = _f(512, "Truncation length during training")
    logging_steps: int = _f(1, "Log every N optimizer steps")
    save_steps: int = _f(0, "Save a checkpoint every N steps (0: only at the end when saving checkpoints)")
    save_checkpoints: bool = _f(False, "Keep intermediate checkpoints (TracIn sums over them)")
    max_grad_norm: float = _f(1.0, "Gradient clipping threshold; 0 disables clipping")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    load_in_4bit: bool = _f(False, "Train against a 4-bit base (NF4, double-quantized, as quantization: 4bit loads it; bitsandbytes); attribution follows the top-level quantization key")
    extra: Dict[str, Any] = _f({}, "Extra keyword arguments passed to the trainer's arguments")


@dataclass
class GradianConfig:
    seed: int = _f(1234, "Seeds everything; part of the index id")
    device: str = _f("auto", "auto (CUDA when visible, else CPU), cpu, cuda, cuda:N or mps")
    dtype: str = _f("auto", "Model dtype: auto, float32, float16, bfloat16 or float64")
    quantization: str = _f("none", "Base model weights at attribution: none (dtype), 4bit (NF4, double-quantized) or 8bit (LLM.int8), through bitsandbytes; the adapter and the computation stay in dtype. For a base that does not fit in dtype, such as a QLoRA run's; part of the index id")
    base_model: str = _f("", "Hub id or local path of the model you fine-tuned from")
    tokenizer: Optional[str] = _f(None, "Tokenizer path if it differs from the base model's")
    adapter_path: Optional[str] = _f(None, "PEFT LoRA adapter directory; required for attribution")
    dataset: Optional[str] = _f(None, "Training data: .jsonl, .json or a save_to_disk directory")
    eval_dataset: Optional[str] = _f(None, "Items describing the capability, with the answers you wanted")
    run: Optional[str] = _f(None, "The training run: a run directory (the trainer's output_dir) or a tracking reference such as runs:/<id>; its config, logs, adapter and data fill what is not given")
    cache_dir: str = _f(".gradian", "Where the content-addressed index cache lives")
    trust_remote_code: bool = _f(False, "Passed to transformers; leave off unless the model needs it")
    attn_implementation: str = _f("eager", "Attention kernel; eager keeps it hookable and deterministic")
    grads: GradsConfig = field(default_factory=GradsConfig, metadata={"help": "Per-example gradient extraction"})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "Attribution engine"})
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig, metadata={"help": "Capability measurement and the significance gate"})
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig, metadata={"help": "How training examples are grouped in the report"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "The optional `gradian train` path; does not affect attribution"})
    audit: AuditConfig = field(default_factory=AuditConfig, metadata={"help": "Thresholds of the audit checks"})
    verdict: VerdictConfig = field(default_factory=VerdictConfig, metadata={"help": "Thresholds of the verdict"})


#: earlier names of a choice, still accepted and rewritten to the current one when loaded
CHOICE_ALIASES: dict[str, dict[str, str]] = {
    "engine.fisher": {"true": "sampled"},
}
#: allowed values of the enumerated fields, by dotted key (``engine.name``: ``gradian.config.engines``)
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda", "mps"),
    "dtype": ("auto", "float32", "float16", "bfloat16", "float64"),
    "quantization": ("none", "4bit", "8bit"),
    "attn_implementation": ("eager", "sdpa", "flash_attention_2"),
    "grads.strategy": ("hooks", "loop", "vmap"),
    "grads.loss_reduction": ("mean", "sum"),
    "grads.normalization": ("none", "l2", "token_count"),
    "grads.block_granularity": ("module", "matrix"),
    "grads.projection_kind": ("countsketch", "rademacher", "kronecker"),
    "grads.storage_dtype": ("float32", "float16"),
    "engine.fisher": ("empirical", "sampled"),
    "engine.checkpoints": ("final", "all"),
    "engine.normalize_train": ("none", "relatif"),
    "engine.rank_items": ("harm", "mean"),
    "engine.store": ("auto", "index", "stream"),
    "engine.replay_start": ("auto", "beginning"),
    "engine.replay_scaling": ("exact", "held"),
    "evaluation.metric": ("exact_match", "contains", "not_contains", "loglik"),
    "evaluation.query_signal": ("auto", "contrastive", "target"),
    "evaluation.query_scope": ("flipped", "lost"),
    "evaluation.query_kept_contrast": ("runner_up", "none"),
    "clustering.method": ("auto", "hdbscan", "kmeans", "declared", "none"),
    "clustering.space": ("text", "gradient", "both", "auto"),
    "clustering.embed_backend": ("auto", "sentence-transformers", "tfidf"),
    "train.backend": ("hf", "trl", "unsloth"),
}
