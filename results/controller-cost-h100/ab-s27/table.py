import json, glob, statistics as st, sys
rows = {}
for f in glob.glob(sys.argv[1] + '/*.json'):
    side, acc, i = f.split('/')[-1][:-5].split('-')
    for r in json.load(open(f))['rows']:
        k = (float(acc), 'turnover' if r['turnover'] else 'steady', r['bs'])
        rows.setdefault(k, {}).setdefault(side, []).append((r['median_us'], r['parts_median_us']['plan'], r['spec_share']))
print('| accept | batch | bs | spec share | min A / B (us) | median A / B | plan min A / B |')
print('|---|---|---|---|---|---|---|')
for k in sorted(rows, key=lambda k: (k[0], k[2], k[1] == 'steady')):
    a, b = rows[k]['old'], rows[k]['new']
    print(f"| {k[0]:g} | {k[1]} | {k[2]} | {b[0][2]:.2f} | {min(x[0] for x in a):.1f} / {min(x[0] for x in b):.1f} | "
          f"{st.median(x[0] for x in a):.1f} / {st.median(x[0] for x in b):.1f} | {min(x[1] for x in a):.1f} / {min(x[1] for x in b):.1f} |")
