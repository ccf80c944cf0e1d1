# Multi30k en->de on CPU: data, nmt prepare, nmt train (small), nmt average, nmt translate, nmt score.
# Every step writes its output atomically and is skipped when that output exists, so `make multi30k` resumes.
#
#   make multi30k                          # DATA defaults to ../shared/data/multi30k when it exists, else downloads
#   make multi30k DATA=/path/to/multi30k   # a local copy: train/val/test_2016_flickr .en/.de(.gz)
#   make multi30k ARCH=tiny LINES=300 TRAIN_MINUTES=1 EXP=/tmp/m30k-smoke   # a quick smoke run

M30K_URL       ?= https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
DATA           ?= $(wildcard ../shared/data/multi30k)
EXP            ?= exp/multi30k
SRC            ?= en
TGT            ?= de
LINES          ?=
BPE_MERGES     ?= 10000
ARCH           ?= small
PRECISION      ?= bf16
MAX_TOKENS     ?= 4096
LR_SCALE       ?= 0.5
WARMUP         ?= 1000
TRAIN_MINUTES  ?= 60
AVERAGE_LAST   ?= 8
KEEP_LAST      ?= 10
BEAM           ?= 4
LENPEN         ?= 0.6
TRAIN_FLAGS    ?=
NMT            ?= nmt

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
	  --test $(M30K_RAW)/test_2016_flickr --bpe-merges $(BPE_MERGES) --max-ratio 9 --out $(EXP)/data --force

# Training resumes from checkpoint_last.pt when interrupted; .done marks a finished run.
$(EXP)/ckpt/.done: $(EXP)/data/meta.json
	$(NMT) train $(EXP)/data --save-dir $(EXP)/ckpt --arch $(ARCH) --precision $(PRECISION) \
	  --max-tokens $(MAX_TOKENS) --lr-scale $(LR_SCALE) --warmup $(WARMUP) --max-time $(TRAIN_MINUTES) \
	  --keep-last $(KEEP_LAST) --seed 1 --device cpu $(TRAIN_FLAGS)
	@touch $@

# The average of the last checkpoints is kept only when it beats the best single checkpoint on val BLEU.
$(EXP)/model.pt: $(EXP)/ckpt/.done
	$(NMT) average --last $(AVERAGE_LAST) $(EXP)/ckpt -o $(EXP)/averaged.pt
	@set -e; for m in averaged best; do \
	  f=$(EXP)/averaged.pt; [ $$m = best ] && f=$(EXP)/ckpt/checkpoint_best.pt; \
	  $(NMT) translate -m $$f -i $(EXP)/data/valid.raw.$(SRC) -o $(EXP)/valid.$$m.hyp --beam $(BEAM) --lenpen $(LENPEN) --quiet; \
	  $(NMT) score --ref $(EXP)/data/valid.raw.$(TGT) --hyp $(EXP)/valid.$$m.hyp --metrics bleu --json > $(EXP)/valid.$$m.json; \
	done
	@python3 -c "import json,shutil,sys; e=sys.argv[1]; \
	  s={m: json.load(open(f'{e}/valid.{m}.json'))[0]['score'] for m in ('averaged','best')}; \
	  pick='averaged' if s['averaged'] > s['best'] else 'best'; \
	  print(f'val BLEU: averaged {s[\"averaged\"]:.2f}, best single {s[\"best\"]:.2f} -> using {pick}'); \
	  shutil.copyfile(f'{e}/averaged.pt' if pick == 'averaged' else f'{e}/ckpt/checkpoint_best.pt', f'{e}/model.pt.tmp')" $(EXP)
	@mv $(EXP)/model.pt.tmp $@

$(EXP)/test.hyp: $(EXP)/model.pt
	$(NMT) translate -m $< -i $(EXP)/data/test.raw.$(SRC) -o $@ --beam $(BEAM) --lenpen $(LENPEN)

multi30k-score: $(EXP)/test.hyp
	$(NMT) score --ref $(EXP)/data/test.raw.$(TGT) --hyp $< --metrics bleu,chrf
