// The console's shell: sign-in, the views (#/fleet, #/timeline, #/reserve, #/events,
// #/operator), the one live event stream every view listens to, and the operator's actions.

import { gql, mutate, token, setToken, Live, ApiError } from './api.js';
import { h, clear, fmtTime, toast, errorText } from './ui.js';
import { fleetView } from './fleet.js';
import { timelineView, reserveForm } from './timeline.js';

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const who = document.getElementById('who');
const liveBadge = document.getElementById('live');
const signout = document.getElementById('signout');

const ctx = {
  viewer: null,
  prefs: JSON.parse(sessionStorage.getItem('compute.prefs') || '{}'),
  poolList: [],
  pools() {
    return this.poolList;
  },
  timers: {},
  debounce(name, f, ms) {
    clearTimeout(this.timers[name]);
    this.timers[name] = setTimeout(f, ms);
  },
  isOperator() {
    return !!this.viewer && this.viewer.roles.includes('OPERATOR');
  },
};
window.addEventListener('compute:rate-limited', (e) => {
  toast(`Over this token's query budget for the minute: ${e.detail.name} is retried in ${e.detail.seconds} s.`, 'error');
});
window.addEventListener('beforeunload', () => sessionStorage.setItem('compute.prefs', JSON.stringify(ctx.prefs)));

let live = null;
let current = null;
const events = [];
const MAX_EVENTS = 500;

signout.addEventListener('click', () => {
  setToken(null);
  if (live) live.close();
  live = null;
  ctx.viewer = null;
  start();
});

async function start() {
  nav.hidden = true;
  signout.hidden = true;
  who.textContent = '';
  liveBadge.textContent = '';
  if (!token()) return signIn();
  try {
    const v = await gql('ConsoleViewer');
    ctx.viewer = v.viewer;
    const fleet = await gql('ConsoleFleet', { window: null });
    ctx.poolList = fleet.sites.nodes.flatMap((s) => s.pools.nodes.map((p) => ({ ...p, siteName: s.name })));
    who.textContent = `${v.viewer.subject}${v.viewer.tenantId ? ` · tenant ${v.viewer.tenantId}` : ''} · ${v.viewer.roles.join(', ').toLowerCase()}`;
    for (const a of nav.querySelectorAll('[data-role]')) a.hidden = !v.viewer.roles.includes(a.dataset.role);
    nav.hidden = false;
    signout.hidden = false;
    startLive(v.eventCursor);
    route();
  } catch (e) {
    if (e instanceof ApiError && (e.code === 'UNAUTHENTICATED' || e.code === 'FORBIDDEN')) setToken(null);
    signIn(errorText(e));
  }
}

async function signIn(problem) {
  const area = h('textarea', { id: 'token', rows: 4, placeholder: 'eyJhbGciOi…', spellcheck: 'false', autocomplete: 'off' });
  const go = h('button', { type: 'submit', class: 'primary', id: 'sign-in' }, 'Sign in');
  const form = h('form', { class: 'signin panel', id: 'signin-form' },
    h('h1', {}, 'Sign in'),
    h('p', {}, 'Paste a bearer token (a JWT). It is kept in this tab only (session storage) and sent in the Authorization header.'),
    area, h('div', { class: 'actions' }, go),
    problem ? h('p', { class: 'error', id: 'signin-error' }, problem) : null);
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const t = area.value.trim().replace(/^Bearer\s+/i, '');
    if (!t) return;
    setToken(t);
    start();
  });
  clear(main, form);
  // `compute-api dev` hands out its development token; `serve` answers 204 (none).
  try {
    const r = await fetch('/console/dev-token');
    if (r.status === 200) {
      const { token: devToken } = await r.json();
      form.querySelector('.actions').append(h('button', {
        type: 'button', id: 'dev-sign-in', onclick: () => {
          setToken(devToken);
          start();
        },
      }, 'Use the development token'));
    }
  } catch {
    // No dev token: nothing to offer.
  }
}

function startLive(cursor) {
  if (live) live.close();
  live = new Live({
    after: cursor,
    onEvent(event) {
      events.unshift(event);
      if (events.length > MAX_EVENTS) events.pop();
      if (current && current.onEvent) current.onEvent(event);
    },
    onStatus(s) {
      liveBadge.className = `live ${s.state}`;
      liveBadge.dataset.state = s.state;
      liveBadge.textContent = s.state === 'live' ? '● live' : s.state === 'reconnecting' ? `○ reconnecting ${s.detail}` : `○ ${s.state}`;
      liveBadge.title = `Live events: ${s.state}${s.detail ? ` (${s.detail})` : ''}; ${s.reconnects} reconnects; resumes after ${s.cursor || 'the present'}`;
      if (current && current.onStatus) current.onStatus(s);
    },
  });
}

const views = {
  fleet: (root) => fleetView(root, ctx),
  timeline: (root) => timelineView(root, ctx),
  reserve: (root) => {
    const form = reserveForm(ctx);
    clear(root, h('h1', {}, 'Reserve'), h('div', { class: 'panel narrow' }, form.element));
    if (ctx.prefs.poolId) form.setPool(ctx.prefs.poolId);
    return { onEvent: form.onEvent };
  },
  events: eventsView,
  operator: operatorView,
};

function route() {
  if (!ctx.viewer) return;
  let name = (location.hash.match(/^#\/(\w+)/) || [])[1] || 'fleet';
  if (!views[name] || (name === 'operator' && !ctx.isOperator())) name = 'fleet';
  for (const a of nav.querySelectorAll('a[data-view]')) a.classList.toggle('active', a.dataset.view === name);
  const root = h('div', { class: `view view-${name}`, id: `view-${name}` });
  clear(main, root);
  current = views[name](root) || {};
}
window.addEventListener('hashchange', route);

function eventsView(root) {
  const filter = h('input', { id: 'events-filter', placeholder: 'type prefix, e.g. reservation.', value: ctx.prefs.eventFilter || '' });
  const status = h('span', { class: 'muted', id: 'events-status' });
  const list = h('ol', { id: 'events', class: 'events' });
  const drop = h('button', { type: 'button', id: 'events-drop', title: 'Close the connection as a network failure would; the stream resumes from its cursor' }, 'Reconnect');
  drop.addEventListener('click', () => live && live.drop());
  clear(root, h('div', { class: 'toolbar' }, h('h1', {}, 'Live events'), filter, drop, status),
    h('p', { class: 'muted' }, ctx.isOperator() ? 'Every event of the fleet (you are an operator).' : `The events of tenant ${ctx.viewer.tenantId}.`),
    list);
  const item = (e) => h('li', { dataset: { type: e.type, id: e.id } },
    h('time', { datetime: e.time }, fmtTime(e.time)), h('span', { class: 'mono type' }, e.type),
    h('span', {}, h('span', { class: 'mono' }, e.subject), summary(e.payload)),
    e.tenantId ? h('span', { class: 'chip' }, e.tenantId) : null,
    h('details', {}, h('summary', {}, 'data'), h('pre', {}, JSON.stringify(e.data, null, 2))));
  const draw = () => {
    const p = filter.value.trim();
    clear(list, events.filter((e) => !p || e.type.startsWith(p)).slice(0, 200).map(item));
  };
  filter.addEventListener('input', () => {
    ctx.prefs.eventFilter = filter.value;
    draw();
  });
  draw();
  const showStatus = (s) => {
    status.textContent = `${s.state} · ${s.reconnects} reconnects · cursor ${s.cursor || '(the present)'}`;
  };
  if (live) showStatus({ state: live.state, reconnects: live.reconnects, cursor: live.cursor });
  return { onEvent: () => ctx.debounce('events', draw, 100), onStatus: showStatus };
}

/// One line from an event's typed payload (`Event.payload`).
function summary(p) {
  if (!p) return null;
  const line = (...parts) => h('span', { class: 'muted summary' }, ` ${parts.filter(Boolean).join(' · ')}`);
  switch (p.__typename) {
    case 'ReservationEventPayload':
      return line(p.reservation.state, `${fmtTime(p.reservation.startsAt)} → ${fmtTime(p.reservation.endsAt)}`);
    case 'NodeEventPayload':
      return line(p.node.hostname, p.node.reachability, p.node.cordoned ? `cordoned${p.node.cordonReason ? `: ${p.node.cordonReason}` : ''}` : null);
    case 'DeviceEventPayload':
      return line(p.device.model, p.device.health, p.device.quarantined ? 'quarantined' : null);
    case 'CommandEventPayload':
      return line(p.command.kind, p.command.state);
    default:
      return null;
  }
}

function operatorView(root) {
  const pools = ctx.pools();
  const poolSelect = h('select', { id: 'operator-pool' }, pools.map((p) => h('option', { value: p.id, selected: p.id === ctx.prefs.poolId }, `${p.siteName} / ${p.name}`)));
  const nodes = h('div', { id: 'operator-nodes' });
  const quotas = h('div', { id: 'operator-quotas' });
  const reason = h('input', { id: 'operator-reason', placeholder: 'reason (recorded with the change)', size: 40 });
  clear(root,
    h('div', { class: 'toolbar' }, h('h1', {}, 'Operator'), h('label', {}, 'Pool ', poolSelect), h('label', {}, 'Reason ', reason)),
    h('div', { class: 'columns' }, h('div', {}, h('h2', {}, 'Nodes and devices'), nodes), h('aside', {}, h('h2', {}, 'Quotas'), quotas)));
  const act = async (name, input, what) => {
    try {
      await mutate(name, { input });
      toast(what, 'ok');
      loadNodes();
    } catch (e) {
      toast(errorText(e), 'error');
    }
  };
  const why = () => reason.value.trim() || null;
  async function loadNodes() {
    try {
      const data = await gql('ConsolePoolNodes', { poolId: poolSelect.value, first: 100 });
      const c = data.computeNodes;
      clear(nodes, h('p', { class: 'muted' }, `${c.totalCount} nodes${c.pageInfo.hasNextPage ? ' (the first 100)' : ''}`),
        h('table', { class: 'table' }, h('thead', {}, h('tr', {}, ['Node', 'Liveness', 'State', 'Devices', 'Actions'].map((t) => h('th', {}, t)))),
          h('tbody', {}, c.nodes.map((n) => h('tr', { dataset: { node: n.id } },
            h('td', { class: 'mono' }, n.hostname),
            h('td', {}, h('span', { class: `badge ${n.reachability.toLowerCase()}` }, n.reachability)),
            h('td', {}, n.cordoned ? h('span', { class: 'badge cordoned', title: n.cordonReason || '' }, `cordoned${n.cordonReason ? `: ${n.cordonReason}` : ''}`) : n.lifecycle.toLowerCase()),
            h('td', {}, n.devices.map((d) => h('div', { class: 'device' }, `${d.model} ${d.mode.toLowerCase()} `,
              d.numaNode !== null || d.nvlinkDomain ? h('span', { class: 'topology muted', title: 'NUMA node · NVLink domain' },
                [d.numaNode !== null ? `NUMA ${d.numaNode}` : null, d.nvlinkDomain].filter(Boolean).join(' · ') + ' ') : null,
              d.health !== 'HEALTHY' ? h('span', { class: 'badge unhealthy', title: d.healthReason || '' }, `${d.health.toLowerCase()}${d.healthReason ? `: ${d.healthReason}` : ''}`) : null,
              d.inventoryMismatch
                ? h('span', { class: 'badge mismatch', title: d.inventoryMismatch }, `out of placement: ${d.inventoryMismatch}`)
                : d.quarantined
                ? h('button', { type: 'button', class: 'link', onclick: () => act('ConsoleUnquarantineDevice', { id: d.id, version: d.version }, `${d.model} on ${n.hostname} back in service`) }, `quarantined (${d.quarantineReason}): release`)
                : h('button', { type: 'button', class: 'link', onclick: () => {
                  if (!why()) return toast('Quarantine needs a reason: fill in Reason first.', 'error');
                  return act('ConsoleQuarantineDevice', { id: d.id, version: d.version, reason: why() }, `${d.model} on ${n.hostname} quarantined`);
                } }, 'quarantine')))),
            h('td', { class: 'actions' },
              n.cordoned
                ? h('button', { type: 'button', onclick: () => act('ConsoleUncordonNode', { id: n.id, version: n.version }, `${n.hostname} uncordoned`) }, 'Uncordon')
                : h('button', { type: 'button', onclick: () => act('ConsoleCordonNode', { id: n.id, version: n.version, reason: why() }, `${n.hostname} cordoned`) }, 'Cordon'),
              h('button', { type: 'button', class: 'danger', onclick: () => act('ConsoleDrainNode', { id: n.id, version: n.version }, `${n.hostname} draining`) }, 'Drain'),
              (n.conditions || []).filter((c) => c.type === 'InventoryMismatch').map((c) => h('div', { class: 'mismatch' },
                h('span', { class: 'badge mismatch', title: c.message || '' }, `the machine differs: ${c.message || ''}`),
                h('button', { type: 'button', onclick: () => act('ConsoleAcceptNodeInventory', { id: n.id, version: n.version }, `${n.hostname}: the report is now its registration`) }, 'Accept report')))))))));
    } catch (e) {
      clear(nodes, h('p', { class: 'error' }, errorText(e)));
    }
  }
  async function loadQuotas() {
    const tenant = h('input', { id: 'quota-tenant', placeholder: 'tenant', required: true });
    const scope = h('select', { id: 'quota-scope' }, pools.map((p) => h('option', { value: p.id }, `pool ${p.siteName} / ${p.name}`)));
    const gpus = h('input', { id: 'quota-gpus', type: 'number', min: 0, step: 0.125, placeholder: 'GPUs' });
    const vcpu = h('input', { id: 'quota-vcpu', type: 'number', min: 0, placeholder: 'vCPU' });
    const memory = h('input', { id: 'quota-memory', type: 'number', min: 0, placeholder: 'memory MiB' });
    const form = h('form', { class: 'form compact', id: 'quota-form' }, tenant, scope, gpus, vcpu, memory, h('button', { type: 'submit' }, 'Set quota'));
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      const num = (el) => (el.value === '' ? null : Number(el.value));
      try {
        await mutate('ConsoleSetQuota', { input: { tenantId: tenant.value.trim(), scopeId: scope.value, gpus: num(gpus), vcpu: num(vcpu), memoryMib: num(memory) } });
        toast(`Quota of ${tenant.value} set.`, 'ok');
        loadQuotas();
      } catch (err) {
        toast(errorText(err), 'error');
      }
    });
    try {
      const data = await gql('ConsoleQuotas', {});
      clear(quotas, form, h('table', { class: 'table' },
        h('thead', {}, h('tr', {}, ['Tenant', 'Scope', 'Resource', 'Used', 'Max'].map((t) => h('th', {}, t)))),
        h('tbody', {}, data.quotas.map((q) => h('tr', {}, h('td', {}, q.tenantId), h('td', { class: 'mono' }, `${q.scopeKind} ${(pools.find((p) => p.id === q.scopeId) || {}).name || q.scopeId}`),
          h('td', {}, q.resource), h('td', {}, q.used), h('td', {}, q.max))))));
    } catch (e) {
      clear(quotas, form, h('p', { class: 'error' }, errorText(e)));
    }
  }
  poolSelect.addEventListener('change', () => {
    ctx.prefs.poolId = poolSelect.value;
    loadNodes();
  });
  loadNodes();
  loadQuotas();
  return {
    onEvent(event) {
      if (/^(node|device)\./.test(event.type)) ctx.debounce('operator', loadNodes, 500);
      if (event.type === 'quota.set') ctx.debounce('quotas', loadQuotas, 500);
    },
  };
}

start();
