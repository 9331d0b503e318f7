// GraphiQL on the vendored bundle: queries and mutations over HTTP, subscriptions over
// graphql-transport-ws on the same /graphql. The console's token (session storage of this tab)
// is put in the Headers editor; GraphiQL sends those headers with every request and as the
// WebSocket's connection_init payload.
(function () {
  const http = new URL('/graphql', window.location.href).href;
  const ws = http.replace(/^http/, 'ws');
  const token = window.sessionStorage.getItem('compute.token');
  const headers = token ? { Authorization: 'Bearer ' + token } : {};
  const fetcher = window.GraphiQL.createFetcher({ url: http, subscriptionUrl: ws });
  // `/graphiql?query=…` opens with that document (a link from the docs or the console).
  const query = new URLSearchParams(window.location.search).get('query');
  const root = window.ReactDOM.createRoot(document.getElementById('graphiql'));
  root.render(
    window.React.createElement(window.GraphiQL, {
      fetcher: fetcher,
      defaultHeaders: JSON.stringify(headers, null, 2),
      shouldPersistHeaders: false,
      defaultEditorToolsVisibility: 'headers',
      query: query || undefined,
      defaultQuery:
        '# Better Compute. Your token (from the console) is in Headers.\n' +
        'query Me {\n  viewer { subject tenantId roles }\n  serverTime\n}\n\n' +
        '# subscription Live {\n#   events { type subject time }\n# }\n',
    }),
  );
})();
