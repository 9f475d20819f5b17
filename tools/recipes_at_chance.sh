#!/usr/bin/env bash
# Issue 29 item 2: a 250-step model=tiny run of each contrastive recipe, then when its contrastive term left chance
# (tools/chance_report.py). CLEAR recipes from scratch on the quickstart data; the continued-training recipes from
# the clear_del_span_reorder run's checkpoint on the shared wiki1m prefix (RankCSE's teachers: that checkpoint too).
#
#   python -m pretrain.quickstart runs/qs --prepare-only        # the quickstart data, once
#   bash tools/recipes_at_chance.sh runs/qs runs/at_chance [ROBERTA_INIT [PAIRS]]   # ~2-3 min a run on 2 idle cores
# With ROBERTA_INIT (tools/tiny_roberta.py --init) SARCSE runs from it, with its BPE tokenizer; with PAIRS
# (tools/sick_triples.py) supervised SimCSE runs from the same start as the others on those triples.
# ONLY="name ..." in the environment runs just those recipes (clear_del_span_reorder is always run: the start).
#   python tools/chance_report.py runs/at_chance
set -u
wanted() { [ -z "${ONLY:-}" ] || [ "$1" = clear_del_span_reorder ] || [[ " $ONLY " == *" $1 "* ]]; }
QS=${1:?quickstart directory (python -m pretrain.quickstart DIR --prepare-only)}
OUT=${2:?output directory}
ROBERTA=${3:-}
PAIRS=${4:-}
DATA=${PRETRAIN_DATA_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
TOK="data.tokenizer=$QS/tokenizer/tokenizer.json"
for name in clear_del_span_reorder clear_del_span clear_del_word clear_subs_del_span; do
  { [ -e "$OUT/$name/checkpoints/latest" ] || ! wanted "$name"; } && continue
  python3 -m pretrain.train "configs/recipes/$name.yaml" model=tiny "run_dir=$OUT/$name" train.max_steps=250 \
    train.log_every=2 "$TOK" "data.sources=[{name: qs, path: $QS/data/train}]" \
    "data.valid=[{name: qs, path: $QS/data/valid}]" > "$OUT/$name.log" 2>&1
done
START=$OUT/clear_del_span_reorder
for name in simcse_unsup_bert_base arccse_bert_base rankcse_listnet_bert_base rankcse_listmle_bert_base; do
  { [ -e "$OUT/$name/checkpoints/latest" ] || ! wanted "$name"; } && continue
  extra=()
  case $name in rankcse*) extra=("objective.rank_distill.teachers=[$START,$START]");; esac
  PRETRAIN_DATA_DIR=$DATA python3 -m pretrain.train "configs/recipes/$name.yaml" model=tiny "run_dir=$OUT/$name" \
    train.max_steps=250 train.log_every=2 "checkpoint.init_from=$START" "$TOK" \
    "data.sentences=$DATA/corpus/wiki1m/wiki1m_for_simcse.txt" "${extra[@]}" > "$OUT/$name.log" 2>&1
done
if [ -n "$PAIRS" ] && wanted simcse_sup_bert_base && [ ! -e "$OUT/simcse_sup_bert_base/checkpoints/latest" ]; then
  python3 -m pretrain.train configs/recipes/simcse_sup_bert_base.yaml model=tiny "run_dir=$OUT/simcse_sup_bert_base" \
    train.max_steps=250 train.log_every=2 "checkpoint.init_from=$START" "$TOK" "data.pairs=$PAIRS" \
    > "$OUT/simcse_sup_bert_base.log" 2>&1
fi
if [ -n "$ROBERTA" ] && wanted sarcse_roberta_base && [ ! -e "$OUT/sarcse_roberta_base/checkpoints/latest" ]; then
  PRETRAIN_DATA_DIR=$DATA python3 -m pretrain.train configs/recipes/sarcse_roberta_base.yaml model=tiny \
    "run_dir=$OUT/sarcse_roberta_base" train.max_steps=250 train.log_every=2 "checkpoint.init_from=$ROBERTA" \
    "data.tokenizer=$ROBERTA/tokenizer.json" "data.sentences=$DATA/corpus/wiki1m/wiki1m_for_simcse.txt" \
    > "$OUT/sarcse_roberta_base.log" 2>&1
fi
