# WMT14 English->German, the paper's base and big models (Vaswani et al., 2017, section 5 and Table 3), on GPUs.
#
#   make wmt14-base GPUS=8                       # one machine, 8 GPUs
#   make wmt14-big GPUS=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=host0   # run on every node with its NODE_RANK
#   make wmt14-base WMT14_DATA=/path/with/tgz    # a local copy of the five statmt.org archives
#   make wmt14-base WMT14_DEVICE=cpu GPUS=2 WMT14_ARCH=tiny WMT14_UPDATES=40 WMT14_SAVE_UPDATES=4 \
#        WMT14_BPE=500 WMT14_EXP=exp/rehearsal   # a CPU rehearsal (tests/test_recipes.py runs one on small archives)
#
# Data as in fairseq's prepare-wmt14en2de.sh: Europarl v7, Common Crawl and News Commentary v9 (about 4.5M
# pairs), punctuation normalized and non-printing characters removed before Moses tokenization; newstest2013
# (dev) and the full newstest2014 (3003 segments, test).
#
# On N nodes, WMT14_EXP must be one folder shared by every node (the training's --save-dir is in it, and
# `nmt train` refuses a save dir some node cannot see). Node 0 alone downloads, prepares, averages, translates
# and scores; the other nodes wait for its data (WMT14_WAIT_MINUTES), train, and stop after training.

# The pair: en-de (Table 2's first column), or en-fr (`make wmt14-en-fr-base` sets it). Section 5.1: en-de a
# shared ~37k BPE vocabulary, en-fr 32,000 word pieces.
WMT14_PAIR         ?= en-de
WMT14_TGT          := $(word 2,$(subst -, ,$(WMT14_PAIR)))
WMT14_DATA         ?=
TEST_DATA          ?= $(wildcard ../shared/data/$(if $(filter en-fr,$(WMT14_PAIR)),wmt14-en-fr,wmt14))
WMT14_EXP          ?= exp/wmt14
WMT14_BPE          ?= $(if $(filter en-fr,$(WMT14_PAIR)),32000,35000)
# The training corpora, kept apart in the data dir (per-corpus filter counts), and their weights in that order:
# the paper's, every pair once per epoch (empty: 1 each). WMT14_WEIGHTS="1 2 1" would see Common Crawl twice.
WMT14_CORPORA      ?= europarl commoncrawl $(if $(filter en-fr,$(WMT14_PAIR)),un news-commentary giga-fren,news-commentary)
WMT14_WEIGHTS      ?=
GPUS               ?= 8
NNODES             ?= 1
NODE_RANK          ?= 0
MASTER_ADDR        ?= localhost
MASTER_PORT        ?= 29500
WMT14_DEVICE       ?= cuda
WMT14_ARCH         ?=
WMT14_UPDATES      ?=
# Numbered checkpoints (what `nmt average --last N` reads) by update count, at the paper's spacing whatever the
# GPU: base trained 100k updates in 12 hours and saved every 10 minutes, 72 checkpoints, one every ~1,400
# updates; big trained 300k updates in 3.5 days, 504 checkpoints, one every ~600. The final update is always
# saved as a numbered checkpoint too. WMT14_SAVE_MINUTES adds a minute interval (0: off).
WMT14_SAVE_MINUTES ?= 0
WMT14_SAVE_UPDATES ?=
WMT14_PRECISION    ?= bf16
WMT14_TEST_LINES   ?= 3003
WMT14_WAIT_MINUTES ?= 180
# Paper: ~25k source + 25k target tokens per update on 8 GPUs. --max-tokens counts padding, so 4096 per GPU
# over 8 GPUs (32,768) gives about 25k real target tokens; recipes/wmt14_batch.py keeps that product for any
# GPUS x NNODES (a higher --update-freq below 8 GPUs, a lower --max-tokens above), and checks the numbers.
ifneq ($(filter wmt14%,$(MAKECMDGOALS)),)
WMT14_BATCH := $(shell python3 recipes/wmt14_batch.py --gpus '$(GPUS)' --nnodes '$(NNODES)' \
                 --node-rank '$(NODE_RANK)' 2>&1)
ifneq ($(.SHELLSTATUS),0)
$(error $(WMT14_BATCH))
endif
endif
WMT14_MAX_TOKENS   ?= $(word 1,$(WMT14_BATCH))
WMT14_UPDATE_FREQ  ?= $(word 2,$(WMT14_BATCH))
WMT14_TRAIN_FLAGS  ?=

WMT14_RAW = $(WMT14_EXP)/raw
ifeq ($(NNODES),1)
TORCHRUN = torchrun --standalone --nproc_per_node $(GPUS)
else
TORCHRUN = torchrun --nnodes $(NNODES) --nproc_per_node $(GPUS) --node_rank $(NODE_RANK) \
           --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT)
endif

.PHONY: wmt14-base wmt14-big wmt14-data
wmt14-data: $(WMT14_RAW)/.done

$(WMT14_RAW)/.done: | install
	python3 recipes/wmt14_data.py --out $(WMT14_RAW) --pair $(WMT14_PAIR) $(if $(WMT14_DATA),--archives $(WMT14_DATA)) \
	  $(if $(TEST_DATA),--test-data $(TEST_DATA)) --test-lines $(WMT14_TEST_LINES)

ifeq ($(NODE_RANK),0)
$(WMT14_EXP)/data/meta.json: $(WMT14_RAW)/.done
	$(NMT) prepare -s en -t $(WMT14_TGT) $(foreach c,$(WMT14_CORPORA),--train $(WMT14_RAW)/train-$(c)) \
	  $(foreach w,$(WMT14_WEIGHTS),--train-weight $(w)) --valid $(WMT14_RAW)/valid --test $(WMT14_RAW)/test \
	  --normalize-punctuation --bpe-merges $(WMT14_BPE) --max-len 250 --max-ratio 1.5 --out $(WMT14_EXP)/data --force
else
# nmt prepare publishes the data folder with one rename, so meta.json there means node 0 finished it. This
# node's own checkout still needs its environment (torchrun, nmt) for the training that follows.
$(WMT14_EXP)/data/meta.json: | install
	python3 recipes/wait_for.py $@ --minutes $(WMT14_WAIT_MINUTES) --what "node 0's data step"
endif

# $(1): base or big; $(2): updates; $(3): checkpoints averaged (and kept); $(4): updates between them.
define WMT14_MODEL
$(WMT14_EXP)/$(1)/.trained: $(WMT14_EXP)/data/meta.json
	$(TORCHRUN) -m nmt_cli train $(WMT14_EXP)/data --save-dir $(WMT14_EXP)/$(1) --arch $(or $(WMT14_ARCH),$(1)) \
	  --max-updates $(or $(WMT14_UPDATES),$(2)) --warmup 4000 --lr-scale 1.0 --label-smoothing 0.1 \
	  --precision $(WMT14_PRECISION) --max-tokens $(WMT14_MAX_TOKENS) --update-freq $(WMT14_UPDATE_FREQ) \
	  --save-interval-minutes $(WMT14_SAVE_MINUTES) --save-interval-updates $(or $(WMT14_SAVE_UPDATES),$(4)) \
	  --keep-last $(3) --valid-interval 1000 --device $(WMT14_DEVICE) --seed 1 \
	  $(if $(and $(filter en-fr,$(WMT14_PAIR)),$(filter big,$(1))),--dropout 0.1) $(WMT14_TRAIN_FLAGS)
	@touch $$@

ifeq ($(NODE_RANK),0)
$(WMT14_EXP)/$(1)/model.pt: $(WMT14_EXP)/$(1)/.trained
	$(NMT) average --last $(3) $(WMT14_EXP)/$(1) -o $$@

$(WMT14_EXP)/$(1)/newstest2014.hyp: $(WMT14_EXP)/$(1)/model.pt
	$(NMT) translate -m $$< -i $(WMT14_EXP)/data/test.raw.en -o $$@ --beam 4 --lenpen 0.6 \
	  --max-len-a 1 --max-len-b 50 --max-tokens 8192 --device $(WMT14_DEVICE) --precision $(WMT14_PRECISION)
	@test $$$$(wc -l < $$@) -eq $$$$(wc -l < $(WMT14_EXP)/data/test.raw.en) || \
	  { echo "wmt14: $$@ does not have one line per test sentence" >&2; rm -f $$@; exit 2; }

wmt14-$(1): $(WMT14_EXP)/$(1)/newstest2014.hyp
	$(NMT) score --ref $(WMT14_EXP)/data/test.raw.$(WMT14_TGT) -i $$< --metrics bleu,chrf \
	  --tokenized-bleu $(WMT14_TGT)
else
wmt14-$(1): $(WMT14_EXP)/$(1)/.trained
	@echo "wmt14-$(1): node $(NODE_RANK) finished training; node 0 averages, translates and scores"
endif
endef

# The paper's Table 3 (recipes/variations.py): the base model with one thing changed per row, 100k updates each
# (WMT14_UPDATES), dev = newstest2013, no averaging; WMT14_EXP/variations/variations.md is the table.
WMT14_VARIATION_ROWS ?= A,B,C,D,E
.PHONY: wmt14-variations
wmt14-variations: $(WMT14_EXP)/data/meta.json
	$(BIN)/python recipes/variations.py --data $(WMT14_EXP)/data --out $(WMT14_EXP)/variations \
	  --base $(or $(WMT14_ARCH),base) --updates $(or $(WMT14_UPDATES),100000) --rows "$(WMT14_VARIATION_ROWS)" \
	  --device $(WMT14_DEVICE) --precision $(WMT14_PRECISION) --launcher "$(TORCHRUN)" \
	  --train-flags "--warmup 4000 --lr-scale 1.0 --max-tokens $(WMT14_MAX_TOKENS) \
	  --update-freq $(WMT14_UPDATE_FREQ) --valid-interval 1000 $(WMT14_TRAIN_FLAGS)"

$(eval $(call WMT14_MODEL,base,100000,5,1400))
$(eval $(call WMT14_MODEL,big,300000,20,600))

# English-French, the paper's other column (38.1 base, 41.8 big; section 6.1: big with P_drop 0.1): the same
# machinery on the pair's five corpora, in its own folder.
WMT14_FR_EXP ?= exp/wmt14-en-fr
.PHONY: wmt14-en-fr-base wmt14-en-fr-big
wmt14-en-fr-base wmt14-en-fr-big:
	$(MAKE) $(subst -en-fr,,$@) WMT14_PAIR=en-fr WMT14_EXP=$(WMT14_FR_EXP)
