# Multi30k en->de (and en->fr: make multi30k-en-fr) on CPU: data, nmt prepare, nmt train (small), nmt average,
# nmt translate, nmt score.
# Every step writes its output atomically and is skipped when that output exists, so `make multi30k` resumes.
#
#   make multi30k                          # DATA defaults to ../shared/data/multi30k when it exists, else downloads
#   make multi30k DATA=/path/to/multi30k   # a local copy: train/val/test_2016_flickr .en/.de(.gz)
#   make multi30k ARCH=tiny LINES=300 TRAIN_MINUTES=1 EXP=exp/m30k-smoke   # a quick smoke run

M30K_URL       ?= https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
DATA           ?= $(wildcard ../shared/data/multi30k)
EXP            ?= exp/multi30k
SRC            ?= en
TGT            ?= de
LINES          ?=
BPE_MERGES     ?= 10000
ARCH           ?= small
PRECISION      ?= auto
MAX_TOKENS     ?= 4096
# Batches of MAX_TOKENS per update, over all processes (nmt train --update-freq UPDATE_FREQ / PROCESSES).
UPDATE_FREQ    ?= 1
# Training processes (torchrun, gloo), the cores shared among them; the update's size stays UPDATE_FREQ batches.
# PROCESSES=2 UPDATE_FREQ=2 trains the literature's Tiny shape 1.2x faster than one process of 2 threads on a
# 2-core Intel Xeon (AMX), and 1.0-1.2x on AMD EPYC (docs/benchmarks.md); `small`'s one batch per update runs
# fastest in one process on the Intel kind.
PROCESSES      ?= 1
LR_SCALE       ?= 0.5
WARMUP         ?= 1000
COOLDOWN       ?= 0.3
ATTENTION_DROPOUT  ?= 0.1
ACTIVATION_DROPOUT ?= 0.1
LABEL_SMOOTHING ?= 0.2
# A moving average of the weights (nmt train --ema): one more candidate for the choice on val; training is the same.
EMA            ?= 0.999
SEED           ?= 1
TRAIN_MINUTES  ?= 60
# The 60 minutes make a host-dependent number of updates; MAX_UPDATES=N TRAIN_MINUTES=0 trains N updates on any
# machine (the cool-down then spans the last 30% of the updates), to reproduce a published row.
MAX_UPDATES    ?= 0
AVERAGE_WINDOWS ?= 3 5 8 10
KEEP_LAST      ?= 10
BEAM           ?= 4
LENPENS        ?= 0.6 1.0 1.4 2.0
TRAIN_FLAGS    ?=
# More nmt prepare flags: --lowercase --normalize-punctuation is the multimodal-MT literature's Multi30k text
# (lowercased, normalized, tokenized); the translations then come out lowercased and the choice on val is made
# against lowercased references.
PREPARE_FLAGS  ?=

M30K_SPLITS = train val test_2016_flickr
M30K_RAW    = $(EXP)/raw

.PHONY: multi30k multi30k-data multi30k-score
multi30k: multi30k-score

# --- data: a local copy (DATA=) used by path, or the public repository's raw files; LINES= keeps the first N lines.
$(M30K_RAW)/.done: | install
	@mkdir -p $(M30K_RAW)
	@set -e; for split in $(M30K_SPLITS); do for lang in $(SRC) $(TGT); do \
	  out=$(M30K_RAW)/$$split.$$lang; \
	  if [ -n "$(DATA)" ]; then \
	    src=$(DATA)/$$split.$$lang; [ -f $$src ] || src=$$src.gz; \
	    [ -f $$src ] || { echo "multi30k: $$src: no such file (DATA=$(DATA))" >&2; exit 2; }; \
	    if [ -n "$(LINES)" ]; then (gzip -cdf $$src | head -n $(LINES) > $$out.tmp) && mv $$out.tmp $$out; \
	    else ln -sf $$(realpath $$src) $$out$$( case $$src in *.gz) echo .gz;; esac ); fi; \
	  else \
	    echo "downloading $$split.$$lang"; \
	    curl -fsSL $(M30K_URL)/$$split.$$lang.gz -o $$out.gz.tmp && mv $$out.gz.tmp $$out.gz; \
	    if [ -n "$(LINES)" ]; then (gzip -cd $$out.gz | head -n $(LINES) > $$out.tmp) && mv $$out.tmp $$out && rm $$out.gz; fi; \
	  fi; done; done
	@touch $@
multi30k-data: $(M30K_RAW)/.done

$(EXP)/data/meta.json: $(M30K_RAW)/.done
	$(NMT) prepare -s $(SRC) -t $(TGT) --train $(M30K_RAW)/train --valid $(M30K_RAW)/val \
	  --test $(M30K_RAW)/test_2016_flickr --bpe-merges $(BPE_MERGES) --max-ratio 9 --out $(EXP)/data --force \
	  $(PREPARE_FLAGS)

ifeq ($(PROCESSES),1)
M30K_TRAIN = $(NMT) train
else
M30K_TRAIN = torchrun --standalone --nproc-per-node $(PROCESSES) -m nmt_cli train \
             --threads $$(( $$(nproc) / $(PROCESSES) > 0 ? $$(nproc) / $(PROCESSES) : 1 ))
endif

# Training resumes from checkpoint_last.pt when interrupted; .done marks a finished run.
$(EXP)/ckpt/.done: $(EXP)/data/meta.json
	@for var in "PROCESSES=$(PROCESSES)" "UPDATE_FREQ=$(UPDATE_FREQ)"; do case "$${var#*=}" in ''|*[!0-9]*|0) \
	  echo "multi30k: $$var: a whole number, at least 1" >&2; exit 2;; esac; done; \
	[ $$(( $(UPDATE_FREQ) % $(PROCESSES) )) -eq 0 ] || { echo "multi30k: UPDATE_FREQ=$(UPDATE_FREQ) batches per \
	update cannot be shared by PROCESSES=$(PROCESSES) processes: give UPDATE_FREQ a multiple of PROCESSES" >&2; exit 2; }
	$(M30K_TRAIN) $(EXP)/data --save-dir $(EXP)/ckpt --arch $(ARCH) --precision $(PRECISION) \
	  --max-tokens $(MAX_TOKENS) --lr-scale $(LR_SCALE) --warmup $(WARMUP) --max-time $(TRAIN_MINUTES) \
	  --max-updates $(MAX_UPDATES) --update-freq $$(( $(UPDATE_FREQ) / $(PROCESSES) )) \
	  --cooldown $(COOLDOWN) --attention-dropout $(ATTENTION_DROPOUT) \
	  --activation-dropout $(ACTIVATION_DROPOUT) --label-smoothing $(LABEL_SMOOTHING) \
	  --keep-last $(KEEP_LAST) --ema $(EMA) --seed $(SEED) --device cpu $(TRAIN_FLAGS)
	@touch $@

# Chosen on val only (recipes/select_on_val.py): the best single checkpoint or the average of the last N
# epoch checkpoints (N in AVERAGE_WINDOWS), then the length penalty among LENPENS.
$(EXP)/model.pt: $(EXP)/ckpt/.done
	$(BIN)/python recipes/select_on_val.py --ckpt-dir $(EXP)/ckpt --src $(EXP)/data/valid.raw.$(SRC) \
	  --ref $(EXP)/data/valid.raw.$(TGT) --windows "$(AVERAGE_WINDOWS)" --lenpens "$(LENPENS)" --beam $(BEAM) \
	  --out $@ --record $(EXP)/selection.json

$(EXP)/test.hyp: $(EXP)/model.pt
	$(NMT) translate -m $< -i $(EXP)/data/test.raw.$(SRC) -o $@  # with the beam and length penalty chosen on val

multi30k-score: $(EXP)/test.hyp
	$(NMT) score --ref $(EXP)/data/test.raw.$(TGT) -i $< --metrics bleu,chrf,lc-bleu --lang $(TGT)
	@echo "$(EXP)/model.pt carries the beam and length penalty chosen on val; nmt is in $(BIN): source $(BIN)/activate"

# The paper's other language pair on CPU: Multi30k English->French (Multi30k's French side of train, val and
# test_2016_flickr), the same recipe, defaults and 60 minutes as `make multi30k`, in FR_EXP.
FR_EXP ?= exp/multi30k-en-fr
.PHONY: multi30k-en-fr
multi30k-en-fr:
	$(MAKE) --no-print-directory multi30k TGT=fr EXP=$(FR_EXP)

# The paper's Table 3 on Multi30k (recipes/variations.py): one model per row, each changing one thing from the
# `small` base (the recipe's training flags), VARIATION_UPDATES updates each, dev = val; EXP/variations/ holds
# the table (variations.md) and the plot. 600 updates: 3-10 minutes per row on 2 cores, 19 rows in 1 h 40 min
# (2-core Intel Xeon (AMX)). VARIATION_ROWS=A,E trains fewer rows. The schedule is
# scaled to the short runs: warmup 200 and a linear cooldown over the last 30% (the recipe's 1,000-update
# warmup would end after the run: the base's dev PPL near update 600 is 38 with it, 21.6 with this one).
VARIATION_UPDATES ?= 600
VARIATION_ROWS    ?= A,B,C,D,E
VARIATION_WARMUP  ?= 200
VARIATION_COOLDOWN ?= 0.3
.PHONY: multi30k-variations
multi30k-variations: $(EXP)/data/meta.json
	$(BIN)/python recipes/variations.py --data $(EXP)/data --out $(EXP)/variations --base $(ARCH) \
	  --updates $(VARIATION_UPDATES) --rows "$(VARIATION_ROWS)" --device cpu --precision $(PRECISION) \
	  --nmt "$(NMT)" --train-flags "--max-tokens $(MAX_TOKENS) --lr-scale $(LR_SCALE) --warmup $(VARIATION_WARMUP) \
	  --cooldown $(VARIATION_COOLDOWN) --attention-dropout $(ATTENTION_DROPOUT) --activation-dropout $(ACTIVATION_DROPOUT) $(TRAIN_FLAGS)"

# Back-translation as a low-resource simulation (recipes/backtranslation.py): half of the training pairs
# parallel, the other half target-only, back-translated by beam and by sampling; one en->de model per row (parallel
# only with seeds 1 and 2, + beam BT, + sampled BT, + tagged sampled BT, all real pairs), BT_UPDATES of training
# each (the backward model BT_BACKWARD_UPDATES or BT_BACKWARD_MINUTES when given), chosen on val, scored on test;
# EXP/bt/ holds the table and plot. The default of 5,000 updates is the budget measured where the ceiling beats the
# parallel half by 3 BLEU on val (fewer limit every row more than their data does): 7 models, about 9 hours on 2
# cores. BT_ROWS="parallel,parallel (seed 2),all real" trains only those rows: the budget at which the ceiling
# beats the parallel half by more than the seed noise, found before paying for the rest.
# TRAIN_MINUTES or MAX_UPDATES given on the command line (or in the environment) sets every model's budget, as it
# sets the main recipe's (TRAIN_MINUTES alone: minutes, no update limit); their file defaults do not.
GIVEN_MINUTES = $(if $(filter-out file default,$(origin TRAIN_MINUTES)),$(TRAIN_MINUTES))
GIVEN_UPDATES = $(if $(filter-out file default,$(origin MAX_UPDATES)),$(MAX_UPDATES))
BT_MINUTES ?= $(or $(GIVEN_MINUTES),0)
BT_UPDATES ?= $(or $(GIVEN_UPDATES),$(if $(GIVEN_MINUTES),0,5000))
BT_WARMUP  ?= 400
BT_BACKWARD_MINUTES ?=
BT_BACKWARD_UPDATES ?=
BT_ROWS    ?=
BT_JOBS    ?= 0
BT_THREADS ?= 0
.PHONY: multi30k-bt
multi30k-bt: $(M30K_RAW)/.done
	$(BIN)/python recipes/backtranslation.py --raw $(M30K_RAW) --out $(EXP)/bt --src $(SRC) --tgt $(TGT) \
	  --arch $(ARCH) --minutes $(BT_MINUTES) --max-updates $(BT_UPDATES) --bpe-merges $(BPE_MERGES) \
	  $(if $(BT_BACKWARD_MINUTES),--backward-minutes $(BT_BACKWARD_MINUTES)) \
	  $(if $(BT_BACKWARD_UPDATES),--backward-updates $(BT_BACKWARD_UPDATES)) $(if $(BT_ROWS),--rows "$(BT_ROWS)") \
	  --jobs $(BT_JOBS) --threads $(BT_THREADS) --precision $(PRECISION) --nmt "$(NMT)" \
	  --train-flags "--max-tokens $(MAX_TOKENS) --lr-scale $(LR_SCALE) \
	  --warmup $(BT_WARMUP) --cooldown $(COOLDOWN) --attention-dropout $(ATTENTION_DROPOUT) \
	  --activation-dropout $(ACTIVATION_DROPOUT) --label-smoothing $(LABEL_SMOOTHING) $(TRAIN_FLAGS)"

# Sequence-level distillation (recipes/distillation.py): the teacher (TEACHER, default this recipe's model.pt,
# built first when missing) translates the training sources; two STUDENT students train DISTILL_MINUTES each,
# on the real and on the distilled targets; EXP/distill/distillation.md gives BLEU, chrF2, parameters and
# sentences/s through nmt and CTranslate2 int8 for all three.
TEACHER         ?= $(EXP)/model.pt
STUDENT         ?= tiny
DISTILL_MINUTES ?= $(or $(GIVEN_MINUTES),10)
DISTILL_WARMUP  ?= 400
.PHONY: multi30k-distill
multi30k-distill: $(TEACHER) $(M30K_RAW)/.done
	$(BIN)/python recipes/distillation.py --raw $(M30K_RAW) --teacher $(TEACHER) --out $(EXP)/distill \
	  --src $(SRC) --tgt $(TGT) --student $(STUDENT) --minutes $(DISTILL_MINUTES) --max-updates $(MAX_UPDATES) \
	  --bpe-merges $(BPE_MERGES) --precision $(PRECISION) --nmt "$(NMT)" --train-flags "--max-tokens $(MAX_TOKENS) \
	  --lr-scale $(LR_SCALE) --warmup $(DISTILL_WARMUP) --cooldown $(COOLDOWN) --label-smoothing $(LABEL_SMOOTHING) $(TRAIN_FLAGS)"

# What each part of the choice on val is worth for the run in EXP (recipes/selection_levers.py): the choice made
# with the recipe's candidates, without the moving average, with one model alone, on the fixed grid; each scored
# on test (BLEU, chrF2, lc-bleu), and last the literature's fixed protocol (average of the last 10, beam 5,
# lenpen 1.0), chosen without val. EXP/levers.json holds the rows.
.PHONY: multi30k-levers
multi30k-levers: $(EXP)/ckpt/.done
	$(BIN)/python recipes/selection_levers.py --ckpt-dir $(EXP)/ckpt --data $(EXP)/data \
	  --windows "$(AVERAGE_WINDOWS)" --lenpens "$(LENPENS)" --beam $(BEAM) --record $(EXP)/levers.json
