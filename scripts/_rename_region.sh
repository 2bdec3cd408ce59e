#!/usr/bin/env bash
# Give "region" one meaning: a block of a tensor (a shard's region, a checkpoint's saved regions,
# RegionIndex, the format's "regions" key). The other meaning, the module subtree whose forward
# runs on split activations (sharded_tensor/_model/regions.py), becomes a *zone*:
#
#   sharded_tensor/_model/regions.py  -> sharded_tensor/_model/zones.py
#   tests/unit/test_regions.py        -> tests/unit/test_zones.py (test_region_ties.py alike)
#   find_regions -> find_zones, RegionForward -> ZoneForward, in_region -> in_zone,
#   _region -> _zone, the module alias _regions -> _zones, and the prose of the files below.
#
# Run once from the repository root, on a clean work tree, after the branches that edit
# regions.py have landed; then run the tests it names at the end and commit.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

if [ ! -f sharded_tensor/_model/regions.py ]; then
    echo "sharded_tensor/_model/regions.py is gone: the rename has been applied already." >&2
    exit 1
fi
if [ -n "$(git status --porcelain)" ]; then
    echo "the work tree has changes; commit or stash them first." >&2
    exit 1
fi

git mv sharded_tensor/_model/regions.py sharded_tensor/_model/zones.py
git mv tests/unit/test_regions.py tests/unit/test_zones.py
if [ -f tests/unit/test_region_ties.py ]; then
    git mv tests/unit/test_region_ties.py tests/unit/test_zone_ties.py
fi

# Files where every "region" means the module subtree: rename the word and every identifier.
# Names of the tensor-block meaning that may appear in them are shielded first.
WHOLE=(
    sharded_tensor/_model/zones.py
    sharded_tensor/_model/registry.py
    sharded_tensor/_model/split_rules.py
    sharded_tensor/_model/signatures.py
    sharded_tensor/_model/parallel.py
    sharded_tensor/_model/pending.py
    sharded_tensor/_model/rule_table.py
    sharded_tensor/_model/strided.py
    tests/unit/test_zones.py
    tests/unit/test_zone_ties.py
    tests/unit/test_split_rules.py
    tests/unit/test_split_rule_registry.py
    docs/extending.md
    docs/huggingface.md
)
for f in "${WHOLE[@]}"; do
    [ -f "$f" ] || continue
    sed -i \
        -e 's/local_region/@@LOCAL_REGION@@/g' \
        -e 's/RegionIndex/@@REGION_INDEX@@/g' \
        -e 's/region_key/@@REGION_KEY@@/g' \
        -e 's/\.region\b/@@DOT_REGION@@/g' \
        -e 's/region/zone/g' \
        -e 's/Region/Zone/g' \
        -e 's/@@LOCAL_REGION@@/local_region/g' \
        -e 's/@@REGION_INDEX@@/RegionIndex/g' \
        -e 's/@@REGION_KEY@@/region_key/g' \
        -e 's/@@DOT_REGION@@/.region/g' \
        "$f"
done

# Everywhere else: only the module's name and path, the identifiers it exports, and the alias
# _regions in the files that import the module under it.
mapfile -t ALIASED < <(git grep -l -E 'import regions as _regions' -- '*.py')
mapfile -t PLAIN < <(git grep -l -E '^ *from sharded_tensor\._model import regions$' -- '*.py')
mapfile -t OTHERS < <(git ls-files '*.py' '*.md' '*.sh' '*.toml' '*.cfg' '*.yml' | grep -v '^scripts/_rename_region.sh$')
sed -i \
    -e 's/_model\.regions\b/_model.zones/g' \
    -e 's/_model import regions as _regions/_model import zones as _zones/g' \
    -e 's/from \. import regions as _regions/from . import zones as _zones/g' \
    -e 's#_model/regions\.py#_model/zones.py#g' \
    -e 's#test_regions\.py#test_zones.py#g' \
    -e 's#test_region_ties\.py#test_zone_ties.py#g' \
    -e 's/\bRegionForward\b/ZoneForward/g' \
    -e 's/\bfind_regions\b/find_zones/g' \
    -e 's/\bin_region\b/in_zone/g' \
    "${OTHERS[@]}"
if [ "${#ALIASED[@]}" -gt 0 ]; then
    sed -i -e 's/\b_regions\b/_zones/g' "${ALIASED[@]}"
fi
if [ "${#PLAIN[@]}" -gt 0 ]; then
    sed -i -e 's/_model import regions$/_model import zones/' -e 's/\bregions\./zones./g' "${PLAIN[@]}"
fi
# Prose of the module subtree in files that also speak of tensor blocks.
sed -i -e 's/the regions, which refuse/the zones, which refuse/' -e 's/so the regions refuse that/so the zones refuse that/' \
    sharded_tensor/_model/record.py
# A test's docstring that speaks of the module subtree.
sed -i -e 's/layer run as a region/layer run as a zone/' tests/distributed/test_extension.py

# Nothing of the old name may remain (checkpoint/_regions.py is the tensor-block meaning: kept).
left=$( (git grep -n -E 'find_regions|RegionForward|in_region[^a-z_]|_model[./]regions|import regions' \
             -- ':!scripts/_rename_region.sh'; git grep -n -w '_regions' -- sharded_tensor "${ALIASED[@]}") || true)
if [ -n "$left" ]; then
    echo "the old names are still used here; rename them by hand:" >&2
    echo "$left" >&2
    exit 1
fi
# The renamed imports sort differently.
"${PYTHON:-python}" -m ruff check --quiet --fix --select I sharding _shardkit sharded_tensor checkpoint tests scripts
PYTHONPATH=. "${PYTHON:-python}" -c "import sharded_tensor, sharded_tensor._model.zones"

git add -A
echo "renamed; now run: pytest tests/unit/test_zones.py tests/unit/test_split_rules.py" \
     "tests/unit/test_split_rule_registry.py tests/unit/test_registry.py tests/test_layering.py" \
     "tests/test_docs.py tests/distributed/test_models.py tests/distributed/test_extension.py, then commit."
