// Small DOM helpers: elements built from data (never from HTML strings, so nothing the API
// returns can become markup), times, toasts, capacity bars, a virtualised list and SVG charts.

const SVG = 'http://www.w3.org/2000/svg';

/// `h('div', { class: 'x', onclick: f }, child, 'text', [more])`.
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  return fill(el, attrs, children);
}

/// The same for SVG elements.
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  return fill(el, attrs, children);
}

function fill(el, attrs, children) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

export function fmtTime(iso) {
  if (!iso) return '—';
  const d = new Date(iso);
  return d.toLocaleString(undefined, { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit' });
}

export function fmtSpan(ms) {
  const m = Math.round(ms / 60000);
  if (m < 60) return `${m} min`;
  if (m < 48 * 60) return `${Math.round((m / 60) * 10) / 10} h`;
  return `${Math.round((m / 1440) * 10) / 10} d`;
}

/// `datetime-local` input value for a Date, in the browser's zone.
export function toLocalInput(d) {
  const pad = (n) => String(n).padStart(2, '0');
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export function toast(message, kind = 'info') {
  const box = document.getElementById('toasts');
  const t = h('div', { class: `toast ${kind}` }, message);
  box.append(t);
  setTimeout(() => t.remove(), kind === 'error' ? 9000 : 4000);
}

/// An error as a person reads it: the stable code, then the message.
export function errorText(e) {
  return e && e.code ? `${e.code}: ${e.message}` : String((e && e.message) || e);
}

/// A capacity bar: `booked` of `total`, labelled.
export function bar(label, booked, total, title) {
  const pct = total > 0 ? Math.min(100, (100 * booked) / total) : 0;
  const level = pct >= 90 ? 'full' : pct >= 60 ? 'busy' : 'ok';
  return h('div', { class: 'cap', title: title || `${booked} of ${total} booked` },
    h('span', { class: 'cap-label' }, label),
    h('span', { class: 'cap-track' }, h('span', { class: `cap-fill ${level}`, dataset: { pct: Math.round(pct) } })),
    h('span', { class: 'cap-num' }, `${total - booked} free / ${total}`));
}

/// Sets every `.cap-fill` width from its `data-pct` (a CSSOM write, which the strict CSP allows
/// where a `style` attribute would not).
export function sizeBars(root) {
  for (const el of root.querySelectorAll('[data-pct]')) el.style.width = `${el.dataset.pct}%`;
}

export function capacityLabel(c) {
  if (c.kind === 'MIG') return `${c.model} MIG ${c.profile || ''}`.trim();
  if (c.kind === 'SLOT') return `${c.model} slots`;
  return `${c.model} GPU`;
}

/// A list that keeps only the rows in view in the DOM: `render(item, index)` returns a row of
/// `rowHeight` pixels. Stays fast with tens of thousands of items.
export function virtualList(items, rowHeight, render, height = 480) {
  const inner = h('div', { class: 'vlist-inner' });
  const outer = h('div', { class: 'vlist' }, inner);
  outer.style.height = `${Math.min(height, Math.max(rowHeight, items.length * rowHeight))}px`;
  inner.style.height = `${items.length * rowHeight}px`;
  let drawn = '';
  const draw = () => {
    const first = Math.max(0, Math.floor(outer.scrollTop / rowHeight) - 5);
    const last = Math.min(items.length, first + Math.ceil(outer.clientHeight / rowHeight) + 10);
    const key = `${first}:${last}`;
    if (key === drawn) return;
    drawn = key;
    const rows = [];
    for (let i = first; i < last; i++) {
      const row = render(items[i], i);
      row.style.position = 'absolute';
      row.style.top = `${i * rowHeight}px`;
      row.style.height = `${rowHeight}px`;
      row.style.left = '0';
      row.style.right = '0';
      rows.push(row);
    }
    inner.replaceChildren(...rows);
  };
  outer.addEventListener('scroll', () => requestAnimationFrame(draw));
  requestAnimationFrame(draw);
  setTimeout(draw, 0);
  // Redraws the rows in view after their items changed in place.
  outer.refresh = () => {
    drawn = '';
    draw();
  };
  return outer;
}

/// A bar chart of `[{label, value, cls}]`.
export function barChart(rows, { width = 360, rowHeight = 22 } = {}) {
  const max = Math.max(1, ...rows.map((r) => r.value));
  const labelW = 90;
  const svg = s('svg', { class: 'chart', viewBox: `0 0 ${width} ${rows.length * rowHeight + 4}`, width, height: rows.length * rowHeight + 4, role: 'img' });
  rows.forEach((r, i) => {
    const y = i * rowHeight + 2;
    const w = ((width - labelW - 50) * r.value) / max;
    svg.append(
      s('text', { x: 0, y: y + rowHeight * 0.7, class: 'chart-label' }, r.label),
      s('rect', { x: labelW, y: y + 3, width: Math.max(1, w), height: rowHeight - 6, class: `chart-bar ${r.cls || ''}` }),
      s('text', { x: labelW + w + 6, y: y + rowHeight * 0.7, class: 'chart-value' }, r.value),
    );
  });
  return svg;
}

/// An area chart of `points = [{t, v}]` against `total`, over `[from, to]`.
export function areaChart(points, total, from, to, { width = 720, height = 140 } = {}) {
  const pad = 28;
  const x = (t) => pad + ((width - pad - 8) * (t - from)) / (to - from);
  const y = (v) => height - 18 - ((height - 30) * v) / Math.max(1, total);
  const svg = s('svg', { class: 'chart', viewBox: `0 0 ${width} ${height}`, width: '100%', height, role: 'img', preserveAspectRatio: 'none' });
  svg.append(s('line', { x1: pad, x2: width - 8, y1: y(total), y2: y(total), class: 'chart-total' }));
  svg.append(s('text', { x: 2, y: y(total) + 4, class: 'chart-label' }, total));
  svg.append(s('text', { x: 2, y: y(0), class: 'chart-label' }, 0));
  if (points.length) {
    const d = [`M ${x(points[0].t)} ${y(0)}`]
      .concat(points.map((p) => `L ${x(p.t)} ${y(p.v)}`))
      .concat([`L ${x(points[points.length - 1].t)} ${y(0)} Z`]);
    svg.append(s('path', { d: d.join(' '), class: 'chart-area' }));
  }
  const now = Date.now();
  if (now > from && now < to) {
    svg.append(s('line', { x1: x(now), x2: x(now), y1: 4, y2: height - 16, class: 'chart-now' }));
    svg.append(s('text', { x: x(now) + 3, y: height - 4, class: 'chart-label' }, 'now'));
  }
  return svg;
}
