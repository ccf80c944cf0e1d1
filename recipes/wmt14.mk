# WMT14 English->German, the paper's base and big models (Vaswani et al., 2017, section 5 and Table 3), on GPUs.
#
#   make wmt14-base GPUS=8                       # one machine, 8 GPUs
#   make wmt14-big GPUS=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=host0   # run on every node with its NODE_RANK
#   make wmt14-base WMT14_DATA=/path/with/tgz    # a local copy of the statmt.org archives
#
# Training data as in fairseq's prepare-wmt14en2de.sh: Europarl v7, Common Crawl, News Commentary v9
# (about 4.5M pairs); newstest2013 (dev) and the full newstest2014 (3003 lines, test).

WMT14_DATA      ?=
TEST_DATA       ?= $(wildcard ../shared/data/wmt14)
WMT14_EXP       ?= exp/wmt14
WMT14_BPE       ?= 35000
GPUS            ?= 8
NNODES          ?= 1
NODE_RANK       ?= 0
MASTER_ADDR     ?= localhost
MASTER_PORT     ?= 29500
WMT14_PRECISION ?= bf16
# Paper: ~25k source + 25k target tokens per update on 8 GPUs. --max-tokens counts padding, so 4096 per GPU
# over 8 GPUs (or their equivalent through --update-freq) gives about 25k real target tokens.
WMT14_MAX_TOKENS ?= 4096
WMT14_UPDATE_FREQ ?= $(shell n=$$(( $(GPUS) * $(NNODES) )); echo $$(( (8 + n - 1) / n )))
WMT14_TRAIN_FLAGS ?=

WMT14_URLS = http://statmt.org/wmt13/training-parallel-europarl-v7.tgz \
             http://statmt.org/wmt13/training-parallel-commoncrawl.tgz \
             http://statmt.org/wmt14/training-parallel-nc-v9.tgz \
             http://statmt.org/wmt14/dev.tgz \
             http://statmt.org/wmt14/test-full.tgz
WMT14_CORPORA = europarl-v7.de-en commoncrawl.de-en training/news-commentary-v9.de-en
WMT14_RAW = $(WMT14_EXP)/raw
TORCHRUN = torchrun --nnodes $(NNODES) --nproc_per_node $(GPUS) --node_rank $(NODE_RANK) \
           --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT)

.PHONY: wmt14-base wmt14-big wmt14-data
wmt14-data: $(WMT14_RAW)/.done

$(WMT14_RAW)/.done: | install
	@mkdir -p $(WMT14_RAW)/orig
	@set -e; cd $(WMT14_RAW)/orig; for url in $(WMT14_URLS); do f=$$(basename $$url); \
	  if [ -n "$(WMT14_DATA)" ] && [ -f "$(WMT14_DATA)/$$f" ]; then ln -sf "$$(realpath $(WMT14_DATA)/$$f)" $$f; \
	  elif [ ! -f $$f ]; then curl -fL --retry 3 $$url -o $$f.tmp && mv $$f.tmp $$f; fi; \
	  tar -xzf $$f; done
	@set -e; for l in en de; do \
	  for c in $(WMT14_CORPORA); do cat $(WMT14_RAW)/orig/$$c.$$l; done > $(WMT14_RAW)/train.$$l.tmp; \
	  mv $(WMT14_RAW)/train.$$l.tmp $(WMT14_RAW)/train.$$l; \
	  if [ -n "$(TEST_DATA)" ]; then \
	    cp $(TEST_DATA)/newstest2013.$$l $(WMT14_RAW)/valid.$$l; cp $(TEST_DATA)/newstest2014.$$l $(WMT14_RAW)/test.$$l; \
	  else \
	    cp $(WMT14_RAW)/orig/dev/newstest2013.$$l $(WMT14_RAW)/valid.$$l; \
	    s=src; [ $$l = de ] && s=ref; \
	    grep '<seg id' $(WMT14_RAW)/orig/test-full/newstest2014-deen-$$s.$$l.sgm \
	      | sed -e 's/<seg id="[0-9]*">\s*//g' -e 's/\s*<\/seg>\s*//g' > $(WMT14_RAW)/test.$$l; \
	  fi; done
	@test $$(wc -l < $(WMT14_RAW)/test.de) -eq 3003 || { echo "wmt14: newstest2014 must have 3003 lines" >&2; exit 2; }
	@touch $@

$(WMT14_EXP)/data/meta.json: $(WMT14_RAW)/.done
	nmt prepare -s en -t de --train $(WMT14_RAW)/train --valid $(WMT14_RAW)/valid --test $(WMT14_RAW)/test \
	  --bpe-merges $(WMT14_BPE) --max-len 250 --max-ratio 1.5 --out $(WMT14_EXP)/data --force

# $(1): base or big; $(2): updates; $(3): checkpoints averaged.
define WMT14_MODEL
$(WMT14_EXP)/$(1)/.trained: $(WMT14_EXP)/data/meta.json
	$(TORCHRUN) -m nmt_cli train $(WMT14_EXP)/data --save-dir $(WMT14_EXP)/$(1) --arch $(1) \
	  --max-updates $(2) --warmup 4000 --lr-scale 1.0 --label-smoothing 0.1 --precision $(WMT14_PRECISION) \
	  --max-tokens $(WMT14_MAX_TOKENS) --update-freq $(WMT14_UPDATE_FREQ) --save-interval-minutes 10 \
	  --keep-last $(3) --valid-interval 1000 --device cuda --seed 1 $(WMT14_TRAIN_FLAGS)
	@touch $$@

$(WMT14_EXP)/$(1)/model.pt: $(WMT14_EXP)/$(1)/.trained
	nmt average --last $(3) $(WMT14_EXP)/$(1) -o $$@

$(WMT14_EXP)/$(1)/newstest2014.hyp: $(WMT14_EXP)/$(1)/model.pt
	nmt translate -m $$< -i $(WMT14_EXP)/data/test.raw.en -o $$@ --beam 4 --lenpen 0.6 \
	  --max-len-a 1 --max-len-b 50 --max-tokens 8192 --device cuda --precision $(WMT14_PRECISION)

wmt14-$(1): $(WMT14_EXP)/$(1)/newstest2014.hyp
	nmt score --ref $(WMT14_EXP)/data/test.raw.de --hyp $$< --metrics bleu,chrf --tokenized-bleu de
endef

$(eval $(call WMT14_MODEL,base,100000,5))
$(eval $(call WMT14_MODEL,big,300000,20))
